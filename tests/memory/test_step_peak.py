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

ZeRO 3 (``test_zero3_planner_matches_step_peak_dp2``) is checked on the sum:
the planner replays the step unit by unit (``megazero/memory/zero3.py``) and
counts parameters and gradients at the joint high-water mark. Two checks per
case: the most parameter bytes held at once (shard + gathered units) equals the
plan to 0.5% - gathering runs in synchronous hooks, so this is exact, and it
pins the root unit, the prefetch depth, units of several layers and
reshard-after-forward; and the peak of the whole model state equals the plan
to 1% (the issue asks for 10%). So tight because it is exact: the plan assumes
no reduce-scatter retires before the launch that pops it (an engine that reaps
early could only hold less), and on gloo none does - every case has matched to
the byte, also with 3 ms of compute added after every gradient.
"""
from __future__ import annotations

from megazero.config import Config
from megazero.memory import PlanSpec, bucket_numels, plan_memory
from megazero.run_plan import RunPlan
from megazero.memory.params import chunk_param_numels
from megazero.data_parallel.engine import MAX_INFLIGHT_BUCKETS
from tests.helpers.dist import spawn
from tests.helpers.step_meter import measure_steps

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


def zero3_config(m: int, precision: str, reshard: bool, prefetch: int = 1, unit_layers: int = 1,
                 grads: str = "fp32", arch: str = "gpt2") -> Config:
    """Four units of blocks, so reshard and keep gather different amounts."""
    return Config.from_flat({
        "arch": arch, "num_layers": 4 * unit_layers, "hidden_size": 64,
        "num_attention_heads": 4, "seq_length": 16, "vocab_size": 1000, "zero": 3, "bf16": precision == "bf16",
        "main_grads_dtype": grads, "micro_batch_size": 2, "global_batch_size": 4 * m, "device": "cpu",
        "bucket_size": 3000, "seed": 5, "reshard_after_forward": reshard, "zero3_prefetch": prefetch,
        "zero3_unit_layers": unit_layers})


ZERO3_CASES = [(m, precision, reshard) for m in (1, 2) for precision in ("fp32", "bf16") for reshard in (True, False)]
ZERO3_CASES += [(1, "fp32", True, 2), (1, "bf16", True, 0), (2, "fp32", True, 1, 2), (2, "bf16", True, 1, 1, "bf16"),
                (2, "bf16", False, 1, 1, "fp32", "llama")]


def run_zero3_cases(pstate) -> list[dict]:
    return [measure_steps(pstate, zero3_config(*case)) for case in ZERO3_CASES]


def test_zero3_planner_matches_step_peak_dp2():
    """m 1/2 x fp32/bf16 x reshard/keep, prefetch 0 and 2, two-block units, bf16 main grads, llama: the
    parameters held at most (exact) and the model state's peak (plan - 10% .. plan) in one dp 2 world."""
    per_rank = spawn(run_zero3_cases, 2)
    bad = []
    for i, case in enumerate(ZERO3_CASES):
        cfg = zero3_config(*case)
        stage = plan_memory(PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, 2), "cpu")).stages[0]
        for rec in (results[i] for results in per_rank):
            total = rec["params_bytes"] + rec["grads_bytes"] + rec["optimizer_bytes"]
            if abs(rec["peak_params_bytes"] - stage.params_peak_bytes) > 0.005 * stage.params_peak_bytes:
                bad.append(f"{case} rank {rec['rank']} params held at most: planned {stage.params_peak_bytes:.0f}, "
                           f"measured {rec['peak_params_bytes']}")
            if abs(total - stage.model_state_bytes) > 0.01 * stage.model_state_bytes:
                bad.append(f"{case} rank {rec['rank']} model-state peak: planned {stage.model_state_bytes:.0f} "
                           f"({stage.params_bytes:.0f} + {stage.grads_bytes:.0f} + {stage.optimizer_bytes:.0f}), "
                           f"measured {total} ({rec['params_bytes']} + {rec['grads_bytes']} + "
                           f"{rec['optimizer_bytes']})")
    assert not bad, "\n".join(bad)


def test_planner_matches_step_peak_dp2():
    """zero 0/1/2 x m 1/2 x fp32/bf16 (+ bf16 main grads): planned model state = measured peak."""
    per_rank = spawn(run_cases, 2)
    bad = []
    for i, case in enumerate(CASES):
        cfg = case_config(*case)
        run_plan = RunPlan.resolve(cfg, 2)
        plan = plan_memory(PlanSpec.from_plan(cfg, run_plan, device="cpu"))
        slack = 0.0
        if case[0] == 2 and case[1] == 1:
            g = 4 if case[3] == "fp32" or case[2] == "fp32" else 2
            buckets = bucket_numels(chunk_param_numels(cfg.model, 1, 2, True, True), 3000, 2, False)
            slack = MAX_INFLIGHT_BUCKETS * max(buckets) * g
        for results in per_rank:
            bad += check(case, results[i], plan.stages[0], slack)
    assert not bad, "\n".join(bad)


def zero3_pp_config(m: int, precision: str, reshard: bool, vp: int | None = None, schedule: str | None = None,
                    arch: str = "gpt2") -> Config:
    """pp 2 x dp 2, four blocks per stage; llama unties the head, gpt2 ties it across the stages."""
    return Config.from_flat({
        "arch": arch, "num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
        "vocab_size": 1000, "zero": 3, "bf16": precision == "bf16", "micro_batch_size": 2,
        "global_batch_size": 4 * m, "device": "cpu", "bucket_size": 3000, "seed": 5,
        "reshard_after_forward": reshard, "pipeline_model_parallel_size": 2, "virtual_pipeline_size": vp,
        "pipeline_schedule": schedule})


ZERO3_PP_CASES = [(4, "fp32", True), (4, "fp32", False), (1, "fp32", True), (4, "fp32", True, None, "gpipe"),
                  (4, "bf16", True, None, None, "llama"), (4, "bf16", True, 2), (4, "bf16", False, 2)]


def run_zero3_pp_cases(pstate) -> list[dict]:
    return [measure_steps(pstate, zero3_pp_config(*case)) for case in ZERO3_PP_CASES]


def test_zero3_planner_matches_step_peak_pp2():
    """Pipelined ZeRO 3 (1F1B, GPipe, interleaved; reshard and keep; tied and untied head): kept units stay
    gathered while micro-batches are in flight, the last stage frees its root after the head's gradients.
    1% as at dp 2, except interleaved: any chunk's last buckets may still be reducing when another chunk's
    backward starts, and the plan takes the worst (measured up to 4.3% under it); 10% there."""
    per_rank = spawn(run_zero3_pp_cases, 4, pp=2)
    bad = []
    for i, case in enumerate(ZERO3_PP_CASES):
        cfg = zero3_pp_config(*case)
        plan = plan_memory(PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, 4), "cpu"))
        tol = 0.1 if plan.spec.run.virtual_stages > 1 else 0.01
        for rec in (results[i] for results in per_rank):
            stage = plan.stages[rec["pp_rank"]]
            total = rec["params_bytes"] + rec["grads_bytes"] + rec["optimizer_bytes"]
            if rec["peak_params_bytes"] != stage.params_peak_bytes or \
                    not (1 - tol) * stage.model_state_bytes <= total <= 1.005 * stage.model_state_bytes:
                bad.append(f"{case} rank {rec['rank']}: planned {stage.params_peak_bytes:.0f} params at most, "
                           f"{stage.model_state_bytes:.0f} at the peak; measured {rec['peak_params_bytes']}, {total}")
    assert not bad, "\n".join(bad)
