"""The DeepSeek-tiny model (MLA attention, one MTP depth; dense, or MoE with DeepSeek routing) trains as one
process does in every layout of issue 43's "Model parity" list, fp32, ITERS iterations.

Per-iteration loss and grad norm within 1e-5 relative of the one-process run of the same model (which keeps
the global batch): pp 2 with 1F1B and interleaved; ep 2 and tp 2 x ep 2 (SP) on the MoE variant; dp 2 at ZeRO
1 and 3; tp 2 x cp 2 x pp 2 x ep 2 at ZeRO 3 with full recompute (8 ranks, the MoE variant: the dense first
layer on stage 0, the MoE one on stage 1); 4 micro-batches against 1 (one process); and ``--compile`` against
eager (one process, aot_eager: dynamo's graphs and AOTAutograd's split without code generation, as
tests/model/test_compile.py's layouts; the MLA block is one graph at tp 1). Reruns of some layouts are bitwise
equal. tp 2 / cp 2 alone are tests/model/test_mla.py's and tests/context_parallel/test_cp_mla.py's.

The MoE variant is DeepSeek's: sigmoid scores, group-limited top-k, the routed scaling factor, the expert bias
(aux-loss-free balancing), the sequence aux loss, a shared expert and a dense first layer. Each world size
trains all its layouts in one spawned world (``run_layouts``, as tests/helpers/moe_runs.py's ``run_many``: the
real build, schedule, ZeRO optimizer and ``Trainer``); the one-process references run once per distinct model
config. ITERS is 5 (``MEGAZERO_PARITY_ITERS`` sets it), as tests/context_parallel/test_cp_mla.py's parity runs (the
same table passed at 20 when this file was written: 103 CPU-seconds against 35).

LAYOUTS is the one table: ``EXTRA`` is merged into every layout's config (and the micro-batch and --compile
runs'), and each MTP depth's logged loss (``mtp_{k}_loss``) is compared beside the loss and grad norm, so MTP in
every layout is ``EXTRA = dict(mtp_num_layers=1)``, as set: DeepSeek-V3's one MTP depth.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from megazero.config import Config
from megazero.model.chunk import routers_of
from megazero.parallel.state import ParallelState
from megazero.training.parallelize import TrainingModel
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import MoERun, serial_config, state_for
from tests.helpers.optimizer_harness import train
from tests.helpers.session_cache import cached
from tests.helpers.tiny_config import SHORT_PARALLEL, degrees, parity_iters, tiny_config

ITERS, TOL = parity_iters(), 1e-5
MLA = dict(arch="llama", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6)
DEEPSEEK_MOE = dict(num_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_num_groups=2,
                    moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=1e-2, moe_aux_loss_coeff=1e-2,
                    moe_router_load_balancing_type="seq_aux_loss", moe_shared_expert_intermediate_size=32,
                    moe_layer_freq=["[0,1]"])
VARIANTS = {"dense": {}, "moe": DEEPSEEK_MOE}
EXTRA: dict[str, Any] = dict(mtp_num_layers=1)  # flat settings every layout adds: one MTP depth, as DeepSeek-V3
NUM_MTP = EXTRA.get("mtp_num_layers") or 0  # each depth's loss is compared too

# (key, world size, variant, layout in tests/helpers/tiny_config.py's short names + flat settings, rerun bitwise)
LAYOUTS: list[tuple[str, int, str, dict[str, Any], bool]] = [
    ("dp2.zero1", 2, "dense", dict(zero=1), False),
    ("dp2.zero3", 2, "moe", dict(zero=3), False),
    ("ep2", 2, "moe", dict(ep=2), True),
    ("pp2.1f1b", 4, "dense", dict(pp=2, schedule="1f1b"), True),
    ("pp2.interleaved", 4, "moe", dict(pp=2, schedule="interleaved", vp=2, num_layers=4,
                                                   moe_layer_freq=["[0,1,1,1]"]), False),
    ("tp2.sp.ep2", 4, "moe", dict(tp=2, sp=True, ep=2), False),
    ("tp2.sp.cp2.pp2.ep2.zero3.full", 8, "moe", dict(tp=2, sp=True, cp=2, pp=2, ep=2, zero=3, recompute="full",
                                                                       global_batch_size=4), False),
]


def mla_cfg(variant: str, **settings: Any) -> Config:
    """The tiny MLA llama (q LoRA 16, latent 8, q/k 8 + 4 RoPE, v 6), 32 tokens, 8 samples of 2 per micro-batch."""
    short = {k: settings.pop(k) for k in list(settings) if k in SHORT_PARALLEL}
    flat = dict(seq_length=32, vocab_size=256, micro_batch_size=2, global_batch_size=8, train_iters=ITERS)
    return tiny_config(**degrees(**short), **{**MLA, **VARIANTS[variant], **flat, **EXTRA, **settings})


def runs_of(world: int) -> list[MoERun]:
    """The LAYOUTS rows of one world size, as ``run_many`` trains them."""
    return [MoERun(key, mla_cfg(variant, **dict(layout)), rerun) for key, w, variant, layout, rerun in LAYOUTS
            if w == world]


def scalars(result: dict[str, Any]) -> list[tuple[float, ...]]:
    """Per iteration: loss, grad norm, then each MTP depth's loss where the run has MTP (``mtp_{k}_loss``)."""
    return [(r["loss"], r["grad_norm"], *[r[k] for k in sorted(r) if k.startswith("mtp_") and k.endswith("_loss")])
            for r in result["records"]]


def _train_with_router_check(pstate: ParallelState, cfg: Config) -> list[tuple[float, ...]]:
    """A run's scalars; its chunks hold routers exactly where a layer is MoE (a run of dense layers only would
    test nothing of the MoE variant)."""
    def check(model: TrainingModel, pstate: ParallelState) -> None:
        for chunk in model.chunks:
            moe = any(cfg.model.is_moe_layer(layer) for layer in chunk.layer_ids)
            assert bool(routers_of(chunk)) == moe, f"layers {chunk.layer_ids}: MoE {moe}, routers {routers_of(chunk)}"
    return scalars(train(pstate, cfg, hook=check))


def run_layouts(pstate: ParallelState, runs: list[MoERun]) -> dict[str, list[list[tuple[float, ...]]]]:
    """Every rank trains every run (twice where ``rerun``), building each new layout's groups collectively."""
    states: dict[Any, ParallelState] = {}
    out = {}
    for run in runs:
        state = state_for(states, run.cfg, pstate.layout.world_size)
        out[run.key] = [_train_with_router_check(state, run.cfg) for _ in range(2 if run.rerun else 1)]
    return out


def serial_scalars(cfgs: list[Config]) -> list[list[tuple[float, ...]]]:
    """The one-process runs (ZeRO 0, no recompute), once per session per config, on one thread as a rank runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [cached(_serial_scalars, serial_config(cfg)) for cfg in cfgs]
    finally:
        torch.set_num_threads(threads)


def _serial_scalars(cfg: Config) -> list[tuple[float, ...]]:
    return scalars(train(ParallelState.serial(), cfg))


def relative_errors(got: list[tuple[float, ...]], want: list[tuple[float, ...]]) -> list[float]:
    """Per iteration, the largest relative difference of its scalars."""
    assert len(got) == len(want) == ITERS and all(len(g) == len(w) == 2 + NUM_MTP for g, w in zip(got, want))
    return [max(abs(g - w) / abs(w) for g, w in zip(step, ref)) for step, ref in zip(got, want)]


def check(results: list[dict], runs: list[MoERun]) -> list[str]:
    """Every rank's records against the one-process run of its model; reruns bitwise."""
    references = serial_scalars([run.cfg for run in runs])
    bad = []
    for run, want in zip(runs, references):
        assert all(math.isfinite(v) for step in want for v in step), (run.key, want)
        for rank, per_rank in enumerate(results):
            first, *again = per_rank[run.key]
            bad += [f"{run.key} rank {rank} iteration {it}: {err:.1e}"
                    for it, err in enumerate(relative_errors(first, want), start=1) if not err <= TOL]
            if again and again[0] != first:
                bad.append(f"{run.key} rank {rank}: the rerun is not bitwise equal")
    return bad


@pytest.mark.parametrize("world", sorted({w for _, w, *_ in LAYOUTS}))
def test_mla_trains_what_one_process_trains(world):
    runs = runs_of(world)
    bad = check(spawn(run_layouts, world, runs), runs)
    assert not bad, "MLA training differs from one process:\n" + "\n".join(bad)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_four_micro_batches_train_what_one_does(variant):
    """One process: the global batch of 8 as 4 micro-batches of 2 against 1 of 8 (the loss a per-token mean over
    the global batch, the aux loss and the expert-bias counts scaled alike)."""
    four, one = serial_scalars([mla_cfg(variant), mla_cfg(variant, micro_batch_size=8)])
    bad = [f"iteration {it}: {err:.1e}" for it, err in enumerate(relative_errors(four, one), start=1)
           if not err <= TOL]
    assert not bad, f"{variant}: 4 micro-batches differ from 1:\n" + "\n".join(bad)


def test_compiled_training_matches_eager():
    """One process, through the real training pieces: --compile (aot_eager) against eager, ITERS iterations. At
    tp 1 without dropout both MLA blocks run one graph (no break, none per layer)."""
    eager = mla_cfg("dense")
    compiled = eager.updated(compile=True, compile_backend="aot_eager")
    (want,) = serial_scalars([eager])
    torch._dynamo.reset()
    counters.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as serial_records runs the eager reference
    try:
        got = scalars(train(ParallelState.serial(), compiled))
    finally:
        torch.set_num_threads(threads)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
    bad = [f"iteration {it}: {err:.1e}" for it, err in enumerate(relative_errors(got, want), start=1)
           if not err <= TOL]
    assert not bad, "compiled training differs from eager:\n" + "\n".join(bad)
