"""Dropout streams per global layer: masks differ where they should, and parallelism keeps the math.

Every layer draws from its own streams (a shared one outside TP regions, a
per-TP-rank one inside them), and the embedding from its own pair, so the
mask a layer draws does not depend on the pipeline split, on virtual stages
or on what other layers drew before. Masks are read off the real modules:
with q = k = 0 the attention probabilities of row i are 1/(i+1), and with
v = identity the attention output *is* the (scaled) attention-dropout mask;
hidden dropout applied to ones gives its mask.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from megazero.checkpoint import storage
from megazero.checkpoint.load import load_rng
from megazero.checkpoint.save import rng_state
from megazero.parallel.layout import Layout
from megazero.model.chunk import blocks_of
from megazero.model.recompute import apply_recompute
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.training.parallelize import build_model_chunks
from tests.helpers.dist import spawn
from tests.helpers.launch import launch
from tests.helpers.pipeline_harness import Run, make_cfg, parity_errors, run_many, serial_reference, train

P = 0.5  # large, so two independent masks of a few hundred elements never coincide
SEQ = 8  # = head dim (hidden 32 / 4 heads), so v = identity fits in one head


def _cfg(arch: str = "gpt2", p: float = P, **layout):
    cfg = make_cfg(arch, seq=SEQ, **layout)
    return cfg.updated(hidden_dropout=p, attention_dropout=p)


def _chunks(cfg, pstate: ParallelState) -> list:
    chunks = build_model_chunks(cfg, RunPlan.resolve(cfg, pstate.layout.world_size), pstate)
    for chunk in chunks:  # parallelize's first step, the one these tests exercise
        apply_recompute(blocks_of(chunk), cfg.training.recompute, cfg.training.recompute_num_layers)
    return chunks


def _attention_mask(block) -> torch.Tensor:
    """The attention-dropout keep-mask [b, n, s, s] (causal part) this block draws next."""
    heads = block.attention.qkv.weight.shape[0] // (3 * SEQ)  # local heads (gpt2: no grouping)
    q = torch.zeros(1, heads, SEQ, SEQ)
    v = torch.eye(SEQ).expand(1, heads, SEQ, SEQ).contiguous()
    with torch.no_grad():
        out = block.attention.core_attention(q, q, v)
    return out != 0


def _hidden_mask(block, tokens: int) -> torch.Tensor:
    """The hidden-dropout keep-mask of this block's next draw on ``tokens`` local sequence positions."""
    with torch.no_grad():
        return block._dropout(torch.ones(tokens, 1, block.cfg.hidden_size)) != 0


def _layer_masks(chunks, sp_size: int = 1, embed_first: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    masks = {}
    for chunk in chunks:
        chunk.train()
        if embed_first and chunk.pre_process:  # the embedding's dropout draws before the layers'
            with torch.no_grad():
                chunk.embedding(torch.zeros(1, SEQ, dtype=torch.long))
        for layer_id, block in chunk.layers.items():
            masks[int(layer_id)] = {"attention": _attention_mask(block), "hidden": _hidden_mask(block, SEQ // sp_size)}
    return masks


def test_layer_masks_do_not_depend_on_other_draws():
    """Serial model: layer 2 draws the same masks whether or not the embedding and layers 0-1 drew first."""
    serial = ParallelState.serial()
    alone = _chunks(_cfg(), serial)[0].train()
    first = {"attention": _attention_mask(alone.layers["2"]), "hidden": _hidden_mask(alone.layers["2"], SEQ)}
    again = {"attention": _attention_mask(alone.layers["2"]), "hidden": _hidden_mask(alone.layers["2"], SEQ)}
    model = _chunks(_cfg(), serial)[0].train()
    with torch.no_grad():
        model.embedding(torch.zeros(1, SEQ, dtype=torch.long))
    for i in ("0", "1"):
        _attention_mask(model.layers[i])
        _hidden_mask(model.layers[i], SEQ)
    after = {"attention": _attention_mask(model.layers["2"]), "hidden": _hidden_mask(model.layers["2"], SEQ)}
    layer0 = _chunks(_cfg(), serial)[0].train().layers["0"]
    for kind in ("attention", "hidden"):
        assert torch.equal(first[kind], after[kind]), f"layer 2's {kind} mask depends on earlier draws"
        assert not torch.equal(first[kind], again[kind]), f"layer 2's {kind} stream did not advance"
    assert not torch.equal(first["attention"], _attention_mask(layer0)), "layers 0 and 2 share a stream"


def probe_layouts(pstate) -> dict:
    """Masks of this rank's layers at tp2 x pp2 (with and without SP; SP again after the embedding drew)
    and at tp1 x dp2 x pp2."""
    out = {"tp_rank": pstate.tp_rank}
    for sp in (False, True):
        out[f"tp2pp2.sp={sp}"] = _layer_masks(_chunks(_cfg(tp=2, pp=2, sp=sp), pstate), 2 if sp else 1)
    out["tp2pp2.sp=True.embed"] = _layer_masks(_chunks(_cfg(tp=2, pp=2, sp=True), pstate), 2, True)
    tp1 = ParallelState.build(Layout(1, 2, 2), "cpu")
    out["tp1pp2"] = _layer_masks(_chunks(_cfg(pp=2), tp1))
    return out


def test_masks_per_layer_and_tp_rank_tp2_pp2():
    results = spawn(probe_layouts, 4, tp=2, pp=2)
    serial = _layer_masks(_chunks(_cfg(), ParallelState.serial()))
    by = {}  # (layout, layer, tp_rank) -> masks
    for r in results:
        for layout in ("tp2pp2.sp=False", "tp2pp2.sp=True", "tp2pp2.sp=True.embed"):
            for layer, masks in r[layout].items():
                by[(layout, layer, r["tp_rank"])] = masks
        for layer, masks in r["tp1pp2"].items():
            by[("tp1pp2", layer)] = masks
    plain, sp = "tp2pp2.sp=False", "tp2pp2.sp=True"
    att = lambda layout, layer, t: by[(layout, layer, t)]["attention"]  # noqa: E731
    hid = lambda layout, layer, t: by[(layout, layer, t)]["hidden"]  # noqa: E731
    assert not torch.equal(att(plain, 0, 0), att(plain, 2, 0)), "layers 0 and 2 (two pp ranks) share attention masks"
    assert not torch.equal(hid(plain, 0, 0), hid(plain, 2, 0)), "layers 0 and 2 share hidden-dropout masks"
    for layer in range(4):
        assert not torch.equal(att(plain, layer, 0), att(plain, layer, 1)), f"layer {layer}: TP ranks share masks"
        assert torch.equal(hid(plain, layer, 0), hid(plain, layer, 1)), f"layer {layer}: replicated masks differ"
        assert not torch.equal(hid(sp, layer, 0), hid(sp, layer, 1)), f"layer {layer}: SP shards share a mask"
        for t in (0, 1):  # under SP the embedding has its own stream: layer masks unchanged by its draw
            assert torch.equal(hid(sp, layer, t), hid(sp + ".embed", layer, t)), f"layer {layer}: embedding's stream"
        # The layout does not change a layer's masks: pp=2 (tp=1) draws what the serial model draws,
        # and the shared (outside-TP) stream is the same at tp=2.
        for kind in ("attention", "hidden"):
            assert torch.equal(by[("tp1pp2", layer)][kind], serial[layer][kind]), f"layer {layer} {kind}: pp != serial"
        assert torch.equal(hid(plain, layer, 0), serial[layer]["hidden"]), f"layer {layer}: tp2 shared != serial"


def dropout_runs() -> list[Run]:
    runs = []
    for arch, schedule in (("gpt2", "gpipe"), ("gpt2", "1f1b"), ("gpt2", "interleaved"), ("llama", "1f1b"),
                           ("llama", "interleaved")):
        cfg = make_cfg(arch, pp=2, schedule=schedule, vp=2 if schedule == "interleaved" else None)
        cfg = cfg.updated(hidden_dropout=0.1, attention_dropout=0.1)
        runs.append(Run(f"{arch}.{schedule}", cfg))
    return runs


def test_pipeline_with_dropout_matches_serial():
    """pp=2 (GPipe, 1F1B, interleaved) with dropout trains exactly as one process does."""
    runs = dropout_runs()
    results = spawn(run_many, 2, runs, pp=2)
    bad = []
    for run in runs:
        ref = serial_reference(run.cfg)
        for rank, per_rank in enumerate(results):
            worst = {k: v for k, v in parity_errors(per_rank[run.key], ref).items() if not v <= 1e-5}
            if worst:
                bad.append(f"{run.key} rank {rank}: {dict(sorted(worst.items(), key=lambda kv: -kv[1])[:4])}")
    assert not bad, "pipeline run with dropout differs from serial:\n" + "\n".join(bad)
    no_dropout = train(make_cfg("gpt2"), ParallelState.serial())["losses"]
    assert results[0]["gpt2.1f1b"]["losses"][0] != no_dropout[0], "dropout had no effect"


def _grads_two_microbatches(mode: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Both micro-batches forward, then both backward (as a pipeline keeps them in flight)."""
    cfg = _cfg("llama", p=0.2).updated(recompute=mode)
    model = _chunks(cfg, ParallelState.serial())[0].train()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    losses = [model(mb[:, :-1], mb[:, 1:]) for mb in tokens]
    for loss in losses:
        loss.backward()
    return [float(x.detach()) for x in losses], {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recompute_replays_every_stream_exactly():
    """selective and full recompute give bitwise the losses and grads of no recompute, micro-batches in flight."""
    ref_losses, ref_grads = _grads_two_microbatches("none")
    for mode in ("selective", "full"):
        losses, grads = _grads_two_microbatches(mode)
        assert losses == ref_losses, mode
        assert all(torch.equal(grads[n], g) for n, g in ref_grads.items()), mode


def test_rng_file_restores_every_stream(tmp_path):
    """save.rng_state / load.load_rng: after loading, the next micro-batch draws the masks it drew before."""
    serial, cfg = ParallelState.serial(), _cfg(p=0.3)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 2, SEQ + 1), generator=torch.Generator().manual_seed(5))

    def loss_of(model, mb):
        with torch.no_grad():
            return float(model(mb[:, :-1], mb[:, 1:]))

    model = _chunks(cfg, serial)[0].train()
    loss_of(model, tokens[0])
    save_file(rng_state(serial, model.ctx.rng), os.path.join(tmp_path, storage.rng_file(0)))
    want = loss_of(model, tokens[1])
    fresh = _chunks(cfg, serial)[0].train()
    assert loss_of(fresh, tokens[1]) != want, "control: a fresh stream should draw other masks"
    fresh = _chunks(cfg, serial)[0].train()
    load_rng(str(tmp_path), serial, fresh.ctx.rng)
    assert loss_of(fresh, tokens[1]) == want


def test_exact_resume_with_dropout_through_pretrain_gpt(tmp_path):
    """tp2 x pp2 (SP) with dropout: resuming from the iteration-3 checkpoint repeats iterations 4-6 bitwise."""
    flags = ["--arch", "gpt2", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
             "--lr", "1e-3", "--lr-decay-iters", "6", "--tp", "2", "--pp", "2", "--sequence-parallel",
             "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]

    def losses(name: str, *extra: str) -> list[float]:
        metrics = str(tmp_path / f"{name}.jsonl")
        for rank, r in enumerate(launch("pretrain_gpt.py", [*flags, *extra, "--metrics-file", metrics], 4)):
            assert r.returncode == 0, f"{name} rank {rank} failed:\n{r.stderr[-3000:]}"
        return [r["loss"] for r in map(json.loads, open(metrics)) if "loss" in r and "event" not in r]

    ckpt = str(tmp_path / "ckpt")
    straight = losses("straight", "--train-iters", "6")
    assert losses("first", "--train-iters", "3", "--save", ckpt) == straight[:3]  # determinism
    assert losses("resumed", "--train-iters", "6", "--load", ckpt) == straight[3:]
