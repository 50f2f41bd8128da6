"""bf16 and fp16 at tp2 x pp2 x dp2 (ZeRO 1 and 2) train what one process trains in the same precision.

The serial reference runs the same code in the same precision on the same global batch, so
what differs is only where 16-bit rounding happens: a TP row-parallel layer rounds each
rank's partial product to 16 bits before the all-reduce, where one process rounds the whole
sum once; PP and DP change nothing else (fp32 main grads, fp32 master weights, fp32 Adam).
Tolerance: half a unit roundoff u of the precision (bf16 2^-8, fp16 2^-11) for the
per-step loss and grad norm (relative) and for the weights (norm-wise, ||a - e|| / ||e||
over the stage's whole model). A layout only moves where 16-bit roundings of size u
happen, and their effects average out in a mean loss, a norm, and a norm-wise error; an
element-wise bound would instead be set by single stored weights flipping one 16-bit step
across a rounding boundary (seen: a LayerNorm weight at 1.0 with a different thread count).
Measured: 0.07-0.12 u (scalars) and 0.11-0.15 u (weights). The serial bf16 and fp16 runs
differ by 3 u of fp16 (checked below), so an fp16 layout that lost precision would fail.
"""
from __future__ import annotations

from megazero.parallel.state import ParallelState
from tests.helpers.compare import precision_errors
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import make_cfg, train

UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}  # unit roundoff: half the spacing just above 1
PRECISION = {"bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 1024.0}}
RUNS = {(p, zero): dict(zero=zero, tp=2, pp=2, mbs=2, clip=1.0, **PRECISION[p])
        for p in PRECISION for zero in (1, 2)}


def run_all(pstate) -> dict:
    return {key: train(pstate, make_cfg(**kw)) for key, kw in RUNS.items()}


def test_bf16_fp16_tp2_pp2_dp2_match_serial():
    serial = {p: train(ParallelState.serial(), make_cfg(zero=0, mbs=8, clip=1.0, **PRECISION[p]))
              for p in PRECISION}
    bad = {}
    for rank, per_run in enumerate(spawn(run_all, 8, tp=2, pp=2)):
        for (precision, zero), run in per_run.items():
            assert not any(r["skipped"] for r in run["records"]), (precision, zero, run["records"])
            errs = precision_errors(run, serial[precision])
            if max(errs) > UNIT[precision] / 2:
                bad[(rank, precision, zero)] = [e / UNIT[precision] for e in errs]
    assert not bad, f"(scalars, weights) errors in units of roundoff: {bad}"
    apart = precision_errors(serial["fp16"], serial["bf16"])[1]
    assert apart > UNIT["fp16"] / 2, f"bf16 and fp16 runs differ by only {apart}: the fp16 bound has no teeth"
