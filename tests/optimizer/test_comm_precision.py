"""Gradient-sync bytes per precision: when ZeRO 1/2 send exactly DDP's bytes, and when not.

ZeRO 1/2 reduce-scatter the main gradients and all-gather the updated compute weights:
(N-1)/N x (main-grad bytes + weight bytes) per parameter. ZeRO 0 all-reduces the main
gradients: 2 (N-1)/N x main-grad bytes. The two agree when both have the same width (fp32, or
bf16 weights with bf16 main grads) and differ with bf16 weights and fp32 main grads (4 + 2
against 8 bytes). Counted by the communication ledger at the collective calls, one step, dp 2.
"""
from __future__ import annotations

from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import make_cfg, train

DP = 2
PRECISIONS = {"fp32": ({}, 4, 4), "bf16+bf16grads": (dict(bf16=True, main_grads_dtype="bf16"), 2, 2),
              "bf16+fp32grads": (dict(bf16=True), 4, 2)}  # name: (flags, main-grad bytes, weight bytes)


def step_bytes(pstate) -> dict:
    out = {}
    for name, (flags, _, _) in PRECISIONS.items():
        for zero in (0, 1, 2):
            run = train(pstate, make_cfg(zero=zero, mbs=4, gbs=8, hidden=64, bucket=10_000, iters=1, **flags))
            comm = run["records"][-1]["comm_bytes"]
            out[name, zero] = (comm.get("all_reduce/dp", 0), comm.get("reduce_scatter/dp", 0),
                               comm.get("all_gather/dp", 0))
    numel = sum(p.numel() for p in run["params"].values())
    return {"bytes": out, "numel": numel}


def test_sharded_traffic_equals_ddp_only_for_equal_widths():
    res = spawn(step_bytes, DP)[0]
    n, per = res["numel"], (DP - 1) / DP
    scalar = 2 * per * 4  # the trainer's loss all-reduce; sharded stages add the squared-norm scalar
    for name, (_, grad_bytes, weight_bytes) in PRECISIONS.items():
        all_reduce0 = res["bytes"][name, 0][0] - scalar
        assert abs(all_reduce0 - 2 * per * grad_bytes * n) <= 0.01 * all_reduce0, (name, res["bytes"][name, 0])
        for zero in (1, 2):
            _, rs, ag = res["bytes"][name, zero]
            assert abs(rs - per * grad_bytes * n) <= 0.01 * rs, (name, zero, rs)
            assert abs(ag - per * weight_bytes * n) <= 0.01 * ag, (name, zero, ag)
            same_as_ddp = abs(rs + ag - all_reduce0) <= 0.01 * all_reduce0
            assert same_as_ddp == (grad_bytes == weight_bytes), (name, zero, rs + ag, all_reduce0)
