"""The planner's model state against what the optimizer holds at its peak during real steps.

Each case runs two real steps on a dp = 2 gloo world and samples the bytes the
optimizer holds (``step_meter``). Tolerance: 2% of each figure, for bucket
padding (every bucket is padded to a multiple of dp x 16 elements; the planner
counts unpadded parameters). One case is a band, not a point: ZeRO 2 with one
micro-batch, where the planner charges the largest window of buckets that can
be in flight (MAX_INFLIGHT_BUCKETS reducing + one filling) and gloo may finish
a reduction, freeing its bucket, before the next one starts: there the measured
peak must lie between the planned one minus MAX_INFLIGHT_BUCKETS of the largest
buckets, and the planned one (+2%).
"""
from __future__ import annotations

from megazero.config import Config
from megazero.memory import PlanSpec, bucket_numels, plan_memory
from megazero.parallel.layout import Layout
from megazero.run_plan import RunPlan
from megazero.memory.params import chunk_param_numels
from megazero.optimizer.grad_sync import MAX_INFLIGHT_BUCKETS
from tests.helpers.dist import spawn
from tests.memory.step_meter import measure_steps

TOL = 0.02
KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes")
CASES = [(zero, m, precision, "fp32") for zero in (0, 1, 2) for m in (1, 2) for precision in ("fp32", "bf16")]
CASES += [(1, 2, "bf16", "bf16"), (2, 1, "bf16", "bf16")]  # bf16 main grads: step() makes fp32 copies


def case_config(zero: int, m: int, precision: str, grads: str, dp: int = 2) -> Config:
    return Config.from_flat({
        "arch": "gpt2", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
        "vocab_size": 1000, "zero": zero, "bf16": precision == "bf16", "main_grads_dtype": grads,
        "micro_batch_size": 2, "global_batch_size": 2 * m * dp, "device": "cpu", "bucket_size": 3000, "seed": 5})


def run_cases(pstate) -> list[dict]:
    return [measure_steps(pstate, case_config(*case)) for case in CASES]


def check(case: tuple, rec: dict, stage, slack: float = 0.0) -> list[str]:
    """Mismatches of one rank's measured peak against the planned stage (empty when it agrees)."""
    bad = []
    for key in KEYS:
        planned, measured = getattr(stage, key), rec[key]
        low = (planned - (slack if key == "grads_bytes" else 0)) * (1 - TOL)
        if not low <= measured <= planned * (1 + TOL):
            bad.append(f"{case} rank {rec['rank']} {key}: planned {planned:.0f}, measured {measured} "
                       f"({100 * (planned - measured) / measured:+.1f}%)")
    return bad


def test_planner_matches_step_peak_dp2():
    """zero 0/1/2 x m 1/2 x fp32/bf16 (+ bf16 main grads): planned model state = measured peak."""
    per_rank = spawn(run_cases, 2)
    bad = []
    for i, case in enumerate(CASES):
        cfg = case_config(*case)
        run_plan = RunPlan.resolve(cfg, Layout.from_world(2, cfg.parallel.tp, cfg.parallel.pp))
        plan = plan_memory(PlanSpec.from_plan(cfg, run_plan, device="cpu"))
        slack = 0.0
        if case[0] == 2 and case[1] == 1:
            g = 4 if case[3] == "fp32" or case[2] == "fp32" else 2
            buckets = bucket_numels(chunk_param_numels(cfg.model, 1, 2, True, True), 3000, 2, False)
            slack = MAX_INFLIGHT_BUCKETS * max(buckets) * g
        for results in per_rank:
            bad += check(case, results[i], plan.stages[0], slack)
    assert not bad, "\n".join(bad)
