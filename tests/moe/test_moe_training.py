"""MoE models train as one process does in every layout (issue 33, "Model parity"), fp32, 20 iterations.

Per-iteration loss and grad norm within 1e-5 relative of the one-process run: ep 2 and 4 (over dp); tp2 x ep2 with
sequence parallelism at etp 1 (selective recompute, a shared expert) and 2; ep2 x pp2 with 1F1B (gpt2: tied
embeddings split over stages; a dense first stage, --moe-layer-freq) and interleaved; ep2 x cp2 with p2p and a2a,
ep4 x cp4 hybrid (a2a+p2p); ep x dp at ZeRO 1, 2 and 3, and ZeRO 1 with the optimizer offloaded; llama and gpt2;
dropless, capacity and all-gather dispatch; hidden dropout at dp 1 (cp2 x pp2 x ep2: dropout masks are equal
across DP ranks by design, so only dp 1 can match one process); tp2 x ep2 x pp2 (8 ranks) at ZeRO 3 with full
recompute; aux-loss-free expert biases (updated each step from counts reduced over all data) at tp2 x ep2 and ep4
ZeRO 3. Reruns of some layouts are bitwise equal; bf16 runs stay finite. The aux and z losses are on in every run,
so their scaling is part of what must agree.

Each world trains all its layouts in one launch through the pieces pretrain_gpt.py uses
(``tests/helpers/moe_runs.py``); the one-process references run once per distinct model config.
"""
from __future__ import annotations

import math

from tests.helpers.dist import spawn
from tests.helpers.moe_runs import MoERun, make_cfg, run_many, serial_config, serial_records

TOL = 1e-5
BF16 = dict(bf16=True)
SHARED = dict(moe_shared_expert_intermediate_size=32)  # a dense expert beside the routed ones, split over tp
BIAS = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2)  # aux-loss-free balancing
RUNS_4 = [
    MoERun("llama.ep4", make_cfg(ep=4), rerun=True),
    MoERun("llama.ep2.zero1", make_cfg(ep=2, zero=1)),
    MoERun("llama.tp2.sp.ep2.etp1.selective.shared", make_cfg(tp=2, ep=2, etp=1, model=SHARED,
                                                              training=dict(recompute="selective"))),
    MoERun("llama.tp2.sp.ep2.etp2.bias", make_cfg(tp=2, ep=2, model=BIAS)),
    MoERun("gpt2.ep2.pp2.1f1b.tied", make_cfg("gpt2", ep=2, pp=2, schedule="1f1b"), rerun=True),
    MoERun("llama.ep2.pp2.first.stage.dense", make_cfg(ep=2, pp=2, model=dict(moe_layer_freq=["[0,1]"]))),
    MoERun("llama.ep2.pp2.interleaved", make_cfg(ep=2, pp=2, schedule="interleaved", vp=2, layers=4)),
    MoERun("llama.ep2.cp2.p2p", make_cfg(ep=2, cp=2)),
    MoERun("gpt2.ep2.cp2.a2a", make_cfg("gpt2", ep=2, cp=2, comm="a2a")),
    MoERun("llama.ep4.cp4.hybrid", make_cfg(ep=4, cp=4, comm="a2a+p2p", parallel=dict(cp_a2a_size=2))),
    MoERun("llama.ep2.zero2.allgather", make_cfg(ep=2, zero=2, parallel=dict(moe_token_dispatcher_type="allgather"))),
    MoERun("llama.ep4.zero3.bias", make_cfg(ep=4, zero=3, model=BIAS)),
    MoERun("llama.ep2.zero1.offload", make_cfg(ep=2, zero=1, parallel=dict(offload_optimizer="cpu"))),
    MoERun("gpt2.ep2.capacity", make_cfg("gpt2", ep=2, model=dict(moe_expert_capacity_factor=1.0))),
    MoERun("llama.cp2.pp2.ep2.dropout", make_cfg(cp=2, pp=2, ep=2, model=dict(hidden_dropout=0.1))),
]
BF16_RUNS = [MoERun("llama.ep4.bf16", make_cfg(ep=4, iters=5, training=BF16))]
RUNS_8 = [MoERun("llama.tp2.sp.ep2.etp1.pp2.zero3.full",
                 make_cfg(tp=2, ep=2, etp=1, pp=2, zero=3, training=dict(recompute="full")), rerun=True)]


def _check(results: list[dict], runs: list[MoERun]) -> list[str]:
    """Every rank's records against the one-process run of the same model; reruns bitwise."""
    distinct: list = []
    for run in runs:
        if serial_config(run.cfg) not in distinct:
            distinct.append(serial_config(run.cfg))
    references = dict(zip(map(id, distinct), serial_records(distinct)))
    bad = []
    for run in runs:
        want = references[id(next(c for c in distinct if c == serial_config(run.cfg)))]
        for rank, per_rank in enumerate(results):
            first, *again = per_rank[run.key]
            assert len(first) == len(want) == run.cfg.training.train_iters, run.key
            for it, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(first, want), start=1):
                errs = (abs(loss - ref_loss) / abs(ref_loss), abs(norm - ref_norm) / abs(ref_norm))
                if not max(errs) <= TOL:
                    bad.append(f"{run.key} rank {rank} iteration {it}: loss {errs[0]:.1e}, grad norm {errs[1]:.1e}")
            if again and again[0] != first:
                bad.append(f"{run.key} rank {rank}: the rerun is not bitwise equal")
    return bad


def test_moe_training_matches_one_process_in_every_layout():
    results = spawn(run_many, 4, RUNS_4 + BF16_RUNS)
    bad = _check(results, RUNS_4)
    for rank, per_rank in enumerate(results):
        (bf16,) = per_rank["llama.ep4.bf16"]
        assert all(math.isfinite(loss) and math.isfinite(norm) for loss, norm in bf16), (rank, bf16)
    assert not bad, "MoE training differs from one process:\n" + "\n".join(bad)


def test_moe_training_8_ranks_zero3_full_recompute():
    bad = _check(spawn(run_many, 8, RUNS_8), RUNS_8)
    assert not bad, "MoE training differs from one process:\n" + "\n".join(bad)
