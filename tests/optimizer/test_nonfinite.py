"""Non-finite gradients skip the step on every rank, in every precision (issue #13).

One tp2 x pp2 x dp2 world (8 gloo ranks). Each case takes a clean step (so the
moments are non-zero), then puts a NaN or an inf into one gradient element on
ONE rank only: tp rank 1, dp rank 1 of the last stage, in a replicated
parameter (a LayerNorm weight), which that rank does not count in the global
norm, so only an agreed check can notice it. The step must then leave every
rank's weights, fp32 master weights, Adam moments and step count bitwise
unchanged, and the next clean step must apply. fp16 must agree on the overflow
over TP, PP and DP: every rank skips and halves its scale.
"""
from __future__ import annotations

import math

import pytest
import torch

from megazero.parallel.state import ParallelState
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.tensor_parallel.layers import spec_of
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import SyntheticBatches, build, make_cfg, train

# (precision, zero, injected value, loss scale floor reached)
CASES = [("fp32", 0, "nan", False), ("fp32", 1, "inf", False), ("fp32", 2, "nan", False),
         ("bf16", 1, "nan", False), ("bf16", 2, "inf", False),
         ("fp16", 0, "inf", False), ("fp16", 2, "nan", False), ("fp16", 1, "inf", True)]
SCALE = 1024.0


def _snapshot(opt) -> tuple[list[torch.Tensor], int]:
    tensors = [buf.param_data for buf in opt.buffers] + opt.store.tensors()
    return [t.clone() for t in tensors], opt.step_count


def _same(a: tuple[list[torch.Tensor], int], b: tuple[list[torch.Tensor], int]) -> bool:
    return a[1] == b[1] and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))


def _replicated_param(chunk):
    """A parameter every TP rank holds whole (not split): counted in the norm on TP rank 0 only."""
    return next(p for name, p in chunk.named_parameters() if spec_of(p).split_dim is None and "norm" in name)


def skip_cases(pstate) -> dict:
    out = {}
    for precision, zero, bad, floor in CASES:
        flags = {"bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": SCALE,
                                                  "min_loss_scale": SCALE if floor else 1.0}}.get(precision, {})
        cfg = make_cfg(zero=zero, tp=2, pp=2, mbs=2, clip=1.0, **flags)
        model = build(pstate, cfg)
        chunks, opt = model.chunks, model.optimizer
        schedule = build_schedule(RunPlan.resolve(cfg, pstate.layout.world_size))
        batches = SyntheticBatches(cfg, pstate.dp_rank, pstate.dp)
        inject = {"on": False}
        target = _replicated_param(chunks[-1])
        value = float(bad)
        target.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), value) if inject["on"] else g)
        steps = []
        for step in range(3):
            inject["on"] = step == 1 and pstate.is_last_stage and pstate.tp_rank == 1 and pstate.dp_rank == 1
            opt.zero_grad()
            schedule(chunks, batches.next_step(), pstate, opt.no_sync)
            before = _snapshot(opt)
            r = opt.step(1e-3)
            steps.append({"skipped": r.skipped, "nonfinite": getattr(r, "nonfinite", None),
                          "scale": r.loss_scale, "unchanged": _same(before, _snapshot(opt)),
                          "step_count": opt.step_count})
        finite = all(bool(torch.isfinite(t).all()) for t in _snapshot(opt)[0])
        out[(precision, zero, bad, floor)] = {"steps": steps, "finite": finite}
    return out


def test_nonfinite_grad_skips_everywhere():
    for rank, res in enumerate(spawn(skip_cases, 8, tp=2, pp=2)):
        for (precision, zero, bad, floor), r in res.items():
            tag = f"rank {rank} {precision} zero {zero} {bad} floor {floor}: {r}"
            steps = r["steps"]
            assert [s["skipped"] for s in steps] == [False, True, False], tag
            assert [s["unchanged"] for s in steps] == [False, True, False], tag
            assert [s["step_count"] for s in steps] == [1, 1, 2], tag
            assert r["finite"], tag
            # a loss-scale overflow above the floor is the scaler's business, not a NaN iteration
            unexplained = precision != "fp16" or floor
            assert [s["nonfinite"] for s in steps] == [False, unexplained, False], tag
            if precision == "fp16":
                expected = [SCALE] * 3 if floor else [SCALE, SCALE / 2, SCALE / 2]
                assert [s["scale"] for s in steps] == expected, tag


def test_loss_scale_search_does_not_stop_a_healthy_fp16_run():
    """2**24 overflows fp16 at once; the halvings down to a workable scale are not counted as failures."""
    cfg = make_cfg(mbs=8, iters=14, fp16=True, initial_loss_scale=2.0 ** 24, max_skipped_steps=2)
    records = train(ParallelState.serial(), cfg)["records"]
    assert [r["iteration"] for r in records] == list(range(1, 15))
    last = records[-1]
    assert last["skipped_iterations"] > 2, last  # the search did skip more than the limit in a row
    assert last["nan_iterations"] == 0, last
    assert last["loss_scale"] < 2.0 ** 24 and not last["skipped"] and math.isfinite(last["loss"]), last


def test_overflow_at_min_loss_scale_stops_after_max_skipped_steps():
    """At the scale floor an overflow is no longer a search step: N in a row stop the run, naming the flag."""
    cfg = make_cfg(mbs=8, iters=10, fp16=True, initial_loss_scale=2.0 ** 24, min_loss_scale=2.0 ** 24,
                   max_skipped_steps=3)
    with pytest.raises(ValueError, match=r"--max-skipped-steps") as err:
        train(ParallelState.serial(), cfg)
    assert "3 consecutive" in str(err.value) and "iteration 3" in str(err.value), str(err.value)
