"""Measured model-state memory and gradient-sync traffic match ZeRO's arithmetic (dp = 4).

Memory: bytes per parameter held by each rank, read from the tensors' storage
right after the optimizer is built, against the ZeRO paper's Psi-arithmetic
(2% plus one bucket of slack for bucket padding and transients).
Traffic: the communication ledger of one training step; ZeRO 1 and 2
(reduce-scatter + all-gather) must send exactly the bytes ZeRO 0's all-reduce
sends, 2 (N-1)/N x gradient bytes.
"""
from __future__ import annotations

from typing import Callable

from megazero.optimizer.accounting import memory_record
from megazero.data_parallel.engine import MAX_INFLIGHT_BUCKETS
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import build, make_cfg, train

DP, BUCKET = 4, 10_000
PRECISIONS = {  # name: (training flags, bytes/param for zero 0, 1, 2 at dp = 4)
    "bf16+bf16grads": (dict(bf16=True, main_grads_dtype="bf16"), (16, 4 + 12 / DP, 2 + 14 / DP)),
    "bf16+fp32grads": (dict(bf16=True), (18, 6 + 12 / DP, 2 + 16 / DP)),
    "fp32": ({}, (16, 8 + 8 / DP, 4 + 12 / DP)),
}
GRAD_BYTES = {"bf16+bf16grads": 2, "bf16+fp32grads": 4, "fp32": 4}
# the trainer's loss all-reduce over dp (fp32, 4 bytes) and, sharded, the grad-norm all-reduce (fp64, 8 bytes)
LOSS_ALL_REDUCE, NORM_ALL_REDUCE = 2 * (DP - 1) / DP * 4, 2 * (DP - 1) / DP * 8


def measure(pstate) -> dict:
    out: dict = {"memory": {}, "comm": {}, "peak_buckets": {}}
    for name, (flags, _) in PRECISIONS.items():
        for zero in (0, 1, 2):
            cfg = make_cfg(zero=zero, mbs=2, hidden=64, bucket=BUCKET, **flags)  # gbs 8 over dp 4
            out["memory"][name, zero] = memory_record(build(pstate, cfg), pstate)
    for zero, mbs in ((0, 2), (1, 2), (2, 2), (2, 1)):  # gbs 8 over dp 4: 1 or 2 micro-batches
        run = train(pstate, make_cfg(zero=zero, mbs=mbs, hidden=64, bucket=BUCKET, iters=2),
                    hook=_count_live_buckets(out["peak_buckets"], (zero, mbs)))
        out["comm"][zero, mbs] = run["records"][-1]["comm_bytes"]
    return out


def _count_live_buckets(peaks: dict, key) -> Callable:
    """After every gradient, record how many full-size bucket gradients exist at once."""

    def hook(model, pstate) -> None:
        peaks[key], optimizer = 0, model.optimizer

        def count(_p) -> None:
            live = sum(b.grad is not None for buf in optimizer.buffers for b in buf.buckets)
            peaks[key] = max(peaks[key], live)

        for buf in optimizer.buffers:
            for p in buf.params:
                p.register_post_accumulate_grad_hook(count)  # runs after the optimizer's own hook

    return hook


def test_memory_and_communication():
    results = spawn(measure, DP)
    problems = []
    for rank, res in enumerate(results):
        for (name, zero), rec in res["memory"].items():
            expected = PRECISIONS[name][1][zero] * rec["num_parameters"]
            measured = rec["params_bytes"] + rec["grads_bytes"] + rec["optimizer_bytes"]
            slack = 0.02 * expected + BUCKET * GRAD_BYTES[name]
            assert rec["event"] == "memory" and rec["rank"] == rank and rec["layout"]["zero"] == zero
            if abs(measured - expected) > slack:
                problems.append(f"rank {rank} {name} zero {zero}: {measured / rec['num_parameters']:.3f} "
                                f"bytes/param, ZeRO arithmetic says {PRECISIONS[name][1][zero]:.3f}")
        n = results[0]["memory"]["fp32", 0]["num_parameters"]
        ideal = 2 * (DP - 1) / DP * 4 * n  # fp32 gradients
        comm = res["comm"]
        zero0 = comm[0, 2]["all_reduce/dp"] - LOSS_ALL_REDUCE
        for key in ((1, 2), (2, 2), (2, 1)):
            sharded = comm[key]["reduce_scatter/dp"] + comm[key]["all_gather/dp"]
            if comm[key]["all_reduce/dp"] != LOSS_ALL_REDUCE + NORM_ALL_REDUCE:
                problems.append(f"rank {rank} zero/mbs {key}: unexpected dp all-reduce {comm[key]}")
            if abs(sharded - zero0) > 0.01 * zero0:
                problems.append(f"rank {rank} zero/mbs {key}: sends {sharded} B over dp, zero 0 sends {zero0} B")
        if abs(zero0 - ideal) > 0.01 * ideal:
            problems.append(f"rank {rank}: zero 0 sends {zero0} B, 2(N-1)/N x grad bytes = {ideal:.0f} B")
        if comm[2, 1]["reduce_scatter/dp"] != comm[1, 2]["reduce_scatter/dp"]:
            problems.append(f"rank {rank}: zero 2 reduce-scatters {comm[2, 1]} vs zero 1 {comm[1, 2]}")
        peak = res["peak_buckets"]
        if peak[2, 2] > MAX_INFLIGHT_BUCKETS + 1:
            problems.append(f"rank {rank}: zero 2 held {peak[2, 2]} full-size bucket grads at once")
        if not (peak[0, 2] == peak[1, 2] > peak[2, 2]):
            problems.append(f"rank {rank}: full-size bucket grads alive {peak}")
    assert not problems, "\n".join(problems)
