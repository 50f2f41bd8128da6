"""QK-clip (``megazero/optimizer/qk_clip.py``) for multi-head latent attention (``megazero/model/mla.py``), and the
bound it promises, for MLA and GQA.

- A crafted case (one process, Muon at lr 0 so only the clip moves weights), with q LoRA (q_up) and without
  (q_proj, a value head wider than the query/key head): layer 0's head 1 gets its query rows blown up past 2 tau.
  The reported max logits equal the fp64 logits of ``MLA.heads`` (1e-5); after the step exactly the rule's rows
  changed: that head's no-position query rows by gamma^alpha, its RoPE query rows by gamma, its kv_up key rows by
  gamma^(1 - alpha); its value rows, every other head, kv_down (the shared RoPE key), q_down and the norms are
  bitwise where they were. Recomputed in fp64 on the same inputs, the head's max logit is tau (1e-6), none above.
- A toy run (lr 0, 3 steps, a new batch each step; MLA and GQA) whose unclipped max logit exceeds 2 tau: after
  every clipped step the same batch's max logit, by the model's own forward, is at most tau (1 + 1e-6).
"""
from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from megazero.context_parallel.logit_max import LogitMax
from megazero.data_parallel.engine import EngineSettings, GradSyncEngine
from megazero.model.chunk import blocks_of
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.optimizer.qk_clip import QKClip
from megazero.optimizer.zero import DistributedOptimizer
from megazero.parallel.state import ParallelState
from megazero.tensor_parallel.layers import initialize_parameters
from tests.helpers.batches import SyntheticBatches
from tests.helpers.compare import rel_err
from tests.helpers.tiny_config import family, tiny_config

TAU, ALPHA, BLOWN, HEAD = 0.3, 0.3, 40.0, 1  # head 1 of layer 0: max logit ~0.8 (> 2 tau); the others ~0.03
MLA = dict(arch="llama", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6)
SHAPES = {"q_lora": {}, "q_proj.wide_v": dict(q_lora_rank=None, v_head_dim=16)}


def query_linear(attention):
    return attention.q_up if attention.cfg.q_lora_rank is not None else attention.q_proj


def head_rows(attention, kind: str, head: int) -> slice:
    """MLA's rows of one head: "q_nope", "q_rope" (of q_up / q_proj), "k_nope", "v" (of kv_up)."""
    dq, dr, dv = attention.dq, attention.dr, attention.dv
    width, lo, hi = {"q_nope": (dq + dr, 0, dq), "q_rope": (dq + dr, dq, dq + dr),
                     "k_nope": (dq + dv, 0, dq), "v": (dq + dv, dq, dq + dv)}[kind]
    return slice(head * width + lo, head * width + hi)


def blow_up(model: GPTModel) -> None:
    """Layer 0's head ``HEAD``: its query rows x ``BLOWN`` (MLA: q_up's / q_proj's; GQA: the fused qkv's)."""
    attention = blocks_of(model)[0].attention
    with torch.no_grad():
        if hasattr(attention, "dq"):
            weight = query_linear(attention).weight
            weight[head_rows(attention, "q_nope", HEAD)] *= BLOWN
            weight[head_rows(attention, "q_rope", HEAD)] *= BLOWN
        else:
            r, d = attention.heads_per_group, attention.cfg.head_dim
            first = (HEAD // r * (r + 2) + HEAD % r) * d
            attention.qkv.weight[first:first + d] *= BLOWN


def clipped_model(**flat: Any) -> dict[str, Any]:
    """A one-process model with layer 0's head blown up, Muon at lr 0 and QK-clip (the trainer's pieces)."""
    cfg = tiny_config(**flat, optimizer="muon", lr=0.0, qk_clip_threshold=TAU, qk_clip_alpha=ALPHA)
    model = GPTModel(cfg.model, TPContext(group=None))
    initialize_parameters(model, cfg.training.seed, None)
    blow_up(model)
    names = {p: n for n, p in model.named_parameters()}
    optimizer = DistributedOptimizer(GradSyncEngine([model], ParallelState.serial(), EngineSettings(bucket_size=3000)),
                                     cfg.optimizer, muon=(cfg.model, names))
    return {"cfg": cfg, "model": model, "optimizer": optimizer,
            "clip": QKClip(cfg, ParallelState.serial(), [model], optimizer)}


def step(run: dict[str, Any], tokens: torch.Tensor) -> None:
    run["clip"].start_step()
    run["optimizer"].zero_grad()
    run["model"](tokens[:, :-1], tokens[:, 1:]).backward()
    run["optimizer"].step(0.0)


@torch.no_grad()
def explicit_max(attention, x: torch.Tensor) -> torch.Tensor:
    """Per head, the max causal logit of an MLA layer on its input ``x`` [s, b, h], in fp64, materialised: the
    layer's own queries and keys (softmax scale folded into q, widths padded) dotted over sqrt(width)."""
    layer = copy.deepcopy(attention).double()
    q, k, _ = layer.heads(x.double())
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_mla_clip_scales_the_rule_s_rows_and_the_head_lands_on_tau(shape):
    run = clipped_model(**{**MLA, **SHAPES[shape]})
    model, clip = run["model"], run["clip"]
    inputs: list[torch.Tensor] = []
    handles = [b.attention.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach().clone()))
               for b in blocks_of(model)]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step(run, torch.cat(SyntheticBatches(run["cfg"], 0, 1).next_step()))
    for h in handles:
        h.remove()
    assert clip.clipped == 1, clip.max_logits
    after = dict(model.named_parameters())
    for layer, (block, x) in enumerate(zip(blocks_of(model), inputs)):
        attention = block.attention
        assert rel_err(clip.max_logits[layer].double(), explicit_max_at(model, attention, x, before)) < 1e-5
        if layer == 0:
            want = explicit_max_at(model, attention, x, before)
            assert float(want[HEAD]) > 2 * TAU and int(want.argmax()) == HEAD, want
            gamma = TAU / float(clip.max_logits[0, HEAD])
            q_name = f"{prefix(model, attention)}.{'q_up' if attention.cfg.q_lora_rank else 'q_proj'}.weight"
            kv_name = f"{prefix(model, attention)}.kv_up.weight"
            expect = {(q_name, "q_nope"): gamma ** ALPHA, (q_name, "q_rope"): gamma,
                      (kv_name, "k_nope"): gamma ** (1 - ALPHA)}
            for (name, kind), factor in expect.items():
                rows = head_rows(attention, kind, HEAD)
                assert rel_err(after[name][rows], before[name][rows] * factor) < 1e-6, (name, kind)
        got = explicit_max(attention, x)
        assert float(got.max()) <= TAU * (1 + 1e-6), (layer, got)
        if layer == 0:
            assert abs(float(got[HEAD]) - TAU) <= 1e-6 * TAU, got
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed == {q_name, kv_name}, changed  # kv_down (the shared RoPE key), q_down, norms, layer 1: untouched
    for name in changed:  # inside them, only the clipped head's rows; kv_up's value rows too stay
        clipped = [head_rows(attention0(model), kind, HEAD) for (n, kind) in expect if n == name]
        mask = torch.ones(before[name].shape[0], dtype=torch.bool)
        for rows in clipped:
            mask[rows] = False
        assert torch.equal(before[name][mask], after[name].detach()[mask]), name


def attention0(model: GPTModel):
    return blocks_of(model)[0].attention


def prefix(model: GPTModel, attention) -> str:
    return next(n for n, m in model.named_modules() if m is attention)


def explicit_max_at(model: GPTModel, attention, x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """``explicit_max`` with the layer's weights as they were in ``weights`` (the model's, before the step)."""
    layer, name = copy.deepcopy(attention), prefix(model, attention)
    with torch.no_grad():
        for sub, param in layer.named_parameters():
            param.copy_(weights[f"{name}.{sub}"])
    return explicit_max(layer, x)


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_after_every_clipped_step_the_same_batch_s_max_logit_is_at_most_tau(kind):
    run = clipped_model(**(MLA if kind == "mla" else family("llama")))
    model, clip = run["model"], run["clip"]
    batches = SyntheticBatches(run["cfg"], 0, 1)
    probe = [LogitMax(run["cfg"].model.num_attention_heads) for _ in blocks_of(model)]
    clipped = []
    for i in range(3):
        tokens = torch.cat(batches.next_step())
        step(run, tokens)
        clipped.append(clip.clipped)
        if i == 0:
            assert float(clip.max_logits.max()) > 2 * TAU, clip.max_logits  # unclipped: over 2 tau
        if clip.clipped:
            for block, sink in zip(blocks_of(model), probe):  # the same batch again, through the model's sinks
                sink.reset()
                block.attention.logit_max = sink
            with torch.no_grad():
                model(tokens[:, :-1], tokens[:, 1:])
            for block, sink in zip(blocks_of(model), clip.sinks):
                block.attention.logit_max = sink
            worst = max(float(s.values.max()) for s in probe)
            assert worst <= TAU * (1 + 1e-6), (i, worst)
    assert clipped[0] == 1, clipped
