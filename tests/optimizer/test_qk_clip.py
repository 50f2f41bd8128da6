"""MuonClip's QK-clip (``megazero/optimizer/qk_clip.py``) and the max logits it reads
(``megazero/context_parallel/logit_max.py``).

- The attention core's per-head max logit equals the max of explicitly materialised, masked q·k/sqrt(d)
  (no SDPA): causal and packed documents, MHA and GQA, query rows taken in several chunks.
- A crafted case (one process, lr 0 so only the clip moves weights): one head's query rows blown up past tau;
  after the step only that head's query rows and its group's key rows changed, by gamma^alpha and
  gamma_min^(1 - alpha) (gamma from the explicit logits); recomputed on the same inputs the head's max logit is
  tau (gpt2 with biases, and llama: GQA, RoPE) and no head is above; under bf16 the working weights are the
  clipped fp32 master cast.
- A spawned world of 2 ranks: dp 2 (ZeRO 1), tp 2 (sequence parallel, ZeRO 1), cp 2 (ring and all-to-all) and
  pp 2 train 3 Muon steps of llama (GQA) with some heads clipped every step (1, 1 and 2 of 8); the heads clipped
  and the max logit per layer of every step match one process, the per-head table of every step too (the first
  step's, from the same weights, layer by layer as ``FIRST`` says: bitwise at dp 2, pp 2, a2a and tp 2's first
  layer, within 1e-6 where the products come from other GEMMs; later steps within 1e-5, as Muon's parity
  leaves the weights), and so do the final weights (2e-5). A world of 4 ranks: ring (cp 4), all-to-all (cp 4)
  and the hybrid (a2a 2 x ring 2) give each rank's heads, max-reduced over the CP group, the fp64 reference's
  per-head maxima (1e-6), with and without documents, MHA, GQA and replicated kv heads; all-to-all bitwise the
  one-process sink's.
- Off by default: no sink, no hook, no fields; the flags refused without Muon and with --qk-layernorm; accepted
  with --compile and --multi-latent-attention (their tests: test_qk_clip_compile.py, test_qk_clip_mla*.py).
"""
from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megazero.config import Config, ConfigError
from megazero.context_parallel import CPContext, CPSplit
from megazero.context_parallel import logit_max as logit_max_module
from megazero.context_parallel.attention import cp_attention
from megazero.context_parallel.logit_max import LogitMax, whole_sequence_logit_max
from megazero.data_parallel.engine import EngineSettings, GradSyncEngine
from megazero.model.chunk import blocks_of
from megazero.model.gpt import GPTModel
from megazero.model.transformer import Attention, TPContext, apply_rotary, rotary_cos_sin
from megazero.optimizer.qk_clip import QKClip, scale_rows
from megazero.optimizer.zero import DistributedOptimizer
from megazero.parallel.state import ParallelState
from megazero.tensor_parallel.layers import initialize_parameters
from megazero.training.metric_sinks import json_safe
from megazero.training.metrics import format_iteration
from tests.helpers.batches import SyntheticBatches
from tests.helpers.compare import rel_err
from tests.helpers.cp_groups import cp_groups
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import layout_of, serial_config
from tests.helpers.optimizer_harness import train
from tests.helpers.tiny_config import degrees, family, tiny_config


def allowed(cuts: tuple[int, ...], s: int) -> torch.Tensor:
    """[s, s] True where query i sees key j: the same document and j <= i."""
    doc = torch.zeros(s, dtype=torch.long)
    for d, start in enumerate(cuts[1:-1]):
        doc[start:] = d + 1
    return (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()


def reference_max(q: torch.Tensor, k: torch.Tensor, bounds) -> torch.Tensor:
    """Per head, the max of the materialised masked scores q·k/sqrt(d) (fp64; kv head of head h: h // (n/g))."""
    b, n, s, d = q.shape
    kx = k.double().repeat_interleave(n // k.shape[1], dim=1)
    scores = q.double() @ kx.transpose(-1, -2) / math.sqrt(d)
    masks = [allowed(bounds[i] if bounds else (0, s), s) for i in range(b)]
    scores = scores.masked_fill(~torch.stack(masks).unsqueeze(1), float("-inf"))
    return scores.amax(dim=(0, 2, 3))


BOUNDS = ((0, 5, 18, 19, 30, 48), (0, 3, 4, 5, 12, 14, 23, 48))  # two samples of S = 48


@pytest.mark.parametrize("kv", [4, 2])
@pytest.mark.parametrize("documents", [False, True])
def test_the_core_reports_the_masked_max_logit(kv, documents, monkeypatch):
    cfg = tiny_config(arch="llama", num_query_groups=kv, seq_length=48).model
    attention = Attention(cfg, TPContext())
    g = torch.Generator().manual_seed(3 + kv)
    q, k, v = (torch.randn(2, h, 48, cfg.head_dim, generator=g) for h in (4, kv, kv))
    k[:, :, 40:] *= 9.0  # late keys dominate: a mask that let early queries see them would show
    bounds = BOUNDS if documents else None
    attention.logit_max = LogitMax(4)
    attention.core_attention(q, k, v, bounds)
    whole = attention.logit_max.values.clone()
    monkeypatch.setattr(logit_max_module, "_BUDGET", 2 * 4 * 48 * 5)  # 5 query rows per chunk
    attention.logit_max.reset()
    attention.core_attention(q, k, v, bounds)
    want = reference_max(q, k, bounds)
    assert rel_err(whole, want) < 1e-6 and rel_err(attention.logit_max.values, want) < 1e-6, (whole, want)
    attention.eval()  # evaluation collects nothing
    attention.logit_max.reset()
    attention.core_attention(q, k, v, bounds)
    assert attention.logit_max.values is None


# -- the crafted clip ---------------------------------------------------------------------------------------
TAU, BLOWN, HEAD = 0.5, 40.0, 1  # head 1 of layer 0 gets its query rows x 40: max logit ~2, others ~0.06


def qkv_rows(attention: Attention) -> dict[str, list[slice]]:
    """Rows of the fused qkv weight per head ("q1") and kv group ("k0", "v0"): the grouped layout."""
    r, d, n = attention.heads_per_group, attention.cfg.head_dim, attention.cfg.num_attention_heads
    rows: dict[str, list[slice]] = {}
    for h in range(n):
        j = h // r
        rows[f"q{h}"] = [slice((j * (r + 2) + h % r) * d, (j * (r + 2) + h % r + 1) * d)]
    for j in range(n // r):
        rows[f"k{j}"] = [slice((j * (r + 2) + r) * d, (j * (r + 2) + r + 1) * d)]
        rows[f"v{j}"] = [slice((j * (r + 2) + r + 1) * d, (j * (r + 2) + r + 2) * d)]
    return rows


def explicit_max(attention: Attention, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """Per head, the max logit of ``attention`` on input ``x`` [s, b, h] with these qkv weights, by hand."""
    cfg, r, d = attention.cfg, attention.heads_per_group, attention.cfg.head_dim
    qkv = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    s, b = x.shape[:2]
    grouped = qkv.view(s, b, -1, r + 2, d).permute(1, 2, 3, 0, 4)  # [b, g, r + 2, s, d]
    q, k = grouped[:, :, :r].reshape(b, -1, s, d), grouped[:, :, r]
    if cfg.arch == "llama":
        cos, sin = rotary_cos_sin(torch.arange(s), cfg)
        q, k = apply_rotary(q, cos.double(), sin.double()), apply_rotary(k, cos.double(), sin.double())
    return reference_max(q, k, None)


def crafted(arch: str, bf16: bool = False) -> dict[str, Any]:
    """One Muon step at lr 0 with QK-clip on a model whose layer 0 head ``HEAD`` has blown-up query rows."""
    cfg = tiny_config(**family(arch), optimizer="muon", lr=0.0, qk_clip_threshold=TAU, qk_clip_alpha=0.3,
                      bf16=bf16)
    model = GPTModel(cfg.model, TPContext(group=None))
    initialize_parameters(model, cfg.training.seed, None)
    attention = blocks_of(model)[0].attention
    with torch.no_grad():
        for rows in qkv_rows(attention)[f"q{HEAD}"]:
            attention.qkv.weight[rows] *= BLOWN
    if bf16:
        model.to(torch.bfloat16)
    names = {p: n for n, p in model.named_parameters()}
    optimizer = DistributedOptimizer(GradSyncEngine([model], ParallelState.serial(), EngineSettings(bucket_size=3000)),
                                     cfg.optimizer, muon=(cfg.model, names))
    clip = QKClip(cfg, ParallelState.serial(), [model], optimizer)
    inputs = []
    handles = [b.attention.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach().clone()))
               for b in blocks_of(model)]
    before = [(b.attention.qkv.weight.detach().clone(), b.attention.qkv.bias) for b in blocks_of(model)]
    before = [(w, None if bias is None else bias.detach().clone()) for w, bias in before]
    tokens = torch.cat(SyntheticBatches(cfg, 0, 1).next_step())
    clip.start_step()
    optimizer.zero_grad()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step(0.0)
    for h in handles:
        h.remove()
    return {"cfg": cfg, "model": model, "optimizer": optimizer, "clip": clip, "inputs": inputs, "before": before}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_only_the_head_over_tau_is_scaled_and_lands_on_tau(arch):
    run = crafted(arch)
    cfg, clip, alpha = run["cfg"], run["clip"], 0.3
    assert clip.clipped == 1 and clip.fields()["qk_clip_count"] == 1
    for layer, (block, x, (w0, b0)) in enumerate(zip(blocks_of(run["model"]), run["inputs"], run["before"])):
        attention = block.attention
        want = explicit_max(attention, x, w0, b0)
        assert rel_err(clip.max_logits[layer].double(), want) < 1e-5, (layer, clip.max_logits[layer], want)
        w1, b1 = attention.qkv.weight.detach(), attention.qkv.bias
        gamma = TAU / float(want[HEAD]) if layer == 0 else 1.0
        group = HEAD // attention.heads_per_group
        expect = {f"q{HEAD}": gamma ** alpha, f"k{group}": gamma ** (1 - alpha)} if layer == 0 else {}
        for name, rows in qkv_rows(attention).items():
            for part in rows:
                factor = expect.get(name)
                if factor is None:  # lr 0: every other row is bitwise where it was
                    assert torch.equal(w1[part], w0[part]), (layer, name)
                else:
                    assert rel_err(w1[part], w0[part] * factor) < 1e-6, (layer, name)
                if b1 is not None and factor is None:
                    assert torch.equal(b1[part], b0[part]), (layer, name)
                elif b1 is not None:
                    assert rel_err(b1[part], b0[part] * factor) < 1e-6, (layer, name)
        after = explicit_max(attention, x, w1, None if b1 is None else b1.detach())
        assert float(after.max()) <= TAU * (1 + 1e-6), (layer, after)
        if layer == 0:
            assert abs(float(after[HEAD]) - TAU) <= 1e-6 * TAU, after  # gamma_min is its own: exactly tau
    assert cfg.optimizer.qk_clip_alpha == alpha


def test_bf16_working_weights_are_the_clipped_master_cast():
    run = crafted("gpt2", bf16=True)
    assert run["clip"].clipped == 1
    qkv = blocks_of(run["model"])[0].attention.qkv.weight
    masters = [(lo, views["master"]) for p, lo, views in run["optimizer"].state_segments() if p is qkv]
    assert masters
    for lo, master in masters:
        assert torch.equal(qkv.detach().view(-1)[lo:lo + master.numel()], master.to(torch.bfloat16))
    w0 = run["before"][0][0]
    assert not torch.equal(qkv.detach(), w0)  # the clip reached the working copy


def test_row_scaling_of_shard_pieces_that_start_and_end_mid_row():
    """A ZeRO shard's piece of a parameter may cut rows anywhere: each element still gets its row's factor."""
    weight = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
    rows = torch.linspace(0.25, 1.0, 7, dtype=torch.float64)
    want = weight * rows.float()[:, None]
    flat = weight.clone().view(-1)
    for lo, hi in ((0, 3), (3, 4), (4, 17), (17, 35)):  # mid-row, inside a row, several rows, to the end
        scale_rows(flat[lo:hi], lo, rows, 5)
    assert torch.equal(flat.view(7, 5), want)


# -- spawned worlds -----------------------------------------------------------------------------------------
def clip_cfg(**flat: Any):
    return tiny_config(**family("llama"), optimizer="muon", lr=0.02, train_iters=3, micro_batch_size=2,
                       global_batch_size=8, qk_clip_threshold=0.052, **flat)


RUNS = {"dp2.z1": clip_cfg(**degrees(zero=1)), "tp2.sp.z1": clip_cfg(**degrees(tp=2, sp=True, zero=1)),
        "cp2.p2p": clip_cfg(**degrees(cp=2, comm="p2p")), "cp2.a2a": clip_cfg(**degrees(cp=2, comm="a2a")),
        "pp2": clip_cfg(**degrees(pp=2))}
# The first step's max logit per layer (so gamma per head) against one process, from the same weights (0.0:
# bitwise). The max is exact, so only the rounding of the q.k products can differ: dp, pp and a2a's head shards
# compute one process's products in its shapes (bitwise); tp 2's layer 0 computes the same q and k (column-parallel
# qkv: the same dot products) but layer 1's input comes through the row-parallel projection's sum, in another
# order than one GEMM's (an ulp); the ring's blocks are GEMMs of other shapes than the whole sequence's.
FIRST = {"dp2.z1": (0.0, 0.0), "tp2.sp.z1": (0.0, 1e-6), "cp2.p2p": (1e-6, 1e-6), "cp2.a2a": (0.0, 0.0),
         "pp2": (0.0, 0.0)}


def clipped_run(pstate: ParallelState, cfg) -> dict[str, Any]:
    """Records, final weights and every step's reduced [layers, heads] max-logit table (read off the trainer's
    QKClip, the optimizer's ``after_update``, after each step)."""
    tables: list[torch.Tensor] = []

    def keep_tables(model, _) -> None:
        step = model.optimizer.step

        def step_and_keep(lr: float):
            result = step(lr)
            tables.append(model.optimizer.after_update.__self__.max_logits.clone())
            return result
        model.optimizer.step = step_and_keep

    result = train(pstate, cfg, hook=keep_tables)
    for record in result["records"]:  # the metrics file's line: strict JSON with the two fields
        line = json.loads(json.dumps(json_safe(record), allow_nan=False))
        assert len(line["max_logit"]) == cfg.model.num_layers and line["qk_clip_count"] == record["qk_clip_count"]
        assert f"qk-clipped heads {record['qk_clip_count']}" in format_iteration(record)  # and the log line
    return {"records": [(r["max_logit"], r["qk_clip_count"], r["loss"]) for r in result["records"]],
            "tables": tables, "params": result["params"]}


def layouts(pstate: ParallelState) -> dict[str, Any]:
    out = {}
    for key, cfg in RUNS.items():
        out[key] = clipped_run(ParallelState.build(layout_of(cfg, pstate.layout.world_size), "cpu"), cfg)
    return out


def cp_maxima(pstate: ParallelState) -> dict[Any, list[float]]:
    """Per CP form, documents and kv heads: this rank's sink, max-reduced over the CP group (cp 4)."""
    rank = dist.get_rank()
    whole, a2a_group, ring_group = cp_groups(4, 2)
    forms = {"p2p": CPContext(group=whole, rank=rank, comm_type="p2p", split=CPSplit(4, 1), ring_group=whole),
             "a2a": CPContext(group=whole, rank=rank, comm_type="a2a", split=CPSplit(4, 4), a2a_group=whole),
             "a2a+p2p": CPContext(group=whole, rank=rank, comm_type="a2a+p2p", split=CPSplit(4, 2),
                                  a2a_group=a2a_group, ring_group=ring_group)}
    out = {}
    for (name, ctx), kv, documents in ((f, kv, docs) for f in forms.items() for kv in (4, 2, 1)
                                        for docs in (False, True)):
        q, k, v = cp_inputs(kv)
        sink = LogitMax(4)
        take = lambda t: ctx.split.take(t, 2, ctx.rank)  # noqa: E731
        cp_attention(take(q), take(k), take(v), ctx, BOUNDS if documents else None, sink)
        values = sink.values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=whole)
        out[name, kv, documents] = values.tolist()
    return out


def cp_inputs(kv: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11 + kv)
    q, k, v = (torch.randn(2, h, 48, 8, generator=g) for h in (4, kv, kv))
    k[:, :, 40:] *= 9.0
    return [q, k, v]


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return spawn(layouts, 2)


def test_dp2_tp2_cp2_pp2_clip_what_one_process_clips(world):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = {key: clipped_run(ParallelState.serial(), serial_config(cfg)) for key, cfg in RUNS.items()}
    finally:
        torch.set_num_threads(threads)
    for key in RUNS:
        ref = serial[key]
        assert all(0 < count < 8 for _, count, _ in ref["records"]), ref["records"]  # some heads, not all
        for rank, per_run in enumerate(world):
            run = per_run[key]
            for (got_max, got_count, _), (want_max, want_count, _) in zip(run["records"], ref["records"]):
                assert got_count == want_count, (key, rank, run["records"], ref["records"])
                assert rel_err(torch.tensor(got_max), torch.tensor(want_max)) < 1e-5, (key, rank)
            assert len(run["tables"]) == len(ref["tables"]) == 3
            for layer, tol in enumerate(FIRST[key]):  # the same weights: bitwise where the products are the same
                first = rel_err(run["tables"][0][layer], ref["tables"][0][layer])
                assert first == 0.0 if tol == 0.0 else first < tol, (key, rank, layer, first)
            for got, want in zip(run["tables"][1:], ref["tables"][1:]):  # then weights Muon moved within 1e-5
                assert rel_err(got, want) < 1e-5, (key, rank)
            bad = {n: rel_err(p, ref["params"][n]) for n, p in run["params"].items()}
            assert all(e < 2e-5 for e in bad.values()), (key, rank, bad)


def test_every_cp_form_reports_the_serial_max_logits():
    per_rank = spawn(cp_maxima, 4, timeout=120)
    for name, kv, documents in per_rank[0]:
        q, k, _ = cp_inputs(kv)
        want = reference_max(q, k, BOUNDS if documents else None)
        serial = LogitMax(4)
        whole_sequence_logit_max(serial, q, k, BOUNDS if documents else None)
        for rank in per_rank:
            assert rel_err(torch.tensor(rank[name, kv, documents], dtype=torch.float64), want) < 1e-6, \
                (name, kv, documents, rank[name, kv, documents], want)
            if name == "a2a":  # whole sequences (documents) of some heads: each head's products as one process's
                assert rank[name, kv, documents] == serial.values.tolist(), (name, kv, documents)


# -- off by default -----------------------------------------------------------------------------------------
def test_off_by_default_collects_nothing_and_the_flags_need_muon():
    cfg = tiny_config(**family("llama"), optimizer="muon", lr=0.02, train_iters=1)
    assert cfg.optimizer.qk_clip_threshold is None
    seen: list[Any] = []
    result = train(ParallelState.serial(), cfg, hook=lambda model, _: seen.append(model))
    model = seen[0]
    assert model.optimizer.after_update is None
    assert all(b.attention.logit_max is None for chunk in model.chunks for b in blocks_of(chunk))
    assert "max_logit" not in result["records"][0] and "qk_clip_count" not in result["records"][0]
    for flat, named in ((dict(qk_clip_threshold=1.0), "--qk-clip-threshold"),
                        (dict(optimizer="muon", qk_clip_alpha=0.2), "--qk-clip-alpha"),
                        (dict(optimizer="muon", qk_clip_threshold=1.0, arch="llama", qk_layernorm=True),
                         "--qk-layernorm")):
        with pytest.raises(ConfigError, match=named):
            Config.from_flat(tiny_config(**flat).to_flat(), explicit=frozenset(flat))
    for flat in (dict(compile=True), dict(arch="llama", multi_latent_attention=True)):  # built: accepted
        flat = dict(optimizer="muon", qk_clip_threshold=1.0, **flat)
        Config.from_flat(tiny_config(**flat).to_flat(), explicit=frozenset(flat))
