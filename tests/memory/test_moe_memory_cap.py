"""Experts larger than a per-rank memory cap train under it, spread over ep ranks or sharded by ZeRO 3 over edp.

The model (``FLAGS``): llama, 2 layers x 64 wide, 8 SwiGLU experts of width 1024 per layer, top-2, the
default corpus's 8000-token vocabulary, fp32. Its 3,145,728 expert weights alone need 48 MiB of model
state on one rank (weights, gradients and Adam's fp32 moments: 16 bytes each) and the whole model 64 MiB
(planned), over the cap of 40 MiB of model state per rank. Two 4-rank pretrain_gpt.py runs train under it, each
rank's model state read from the tensors' own storage (the run's ``"event": "memory"`` records):

    --ep 4 (ZeRO 0)       2 experts per rank, edp 1                      (planned 28 MiB per rank)
    --ep 2 --zero 3       4 experts per rank, their state sharded over   (planned 35 MiB at the step's peak,
                          edp 2 (dense over dp 4)                          an upper bound: moe_plan.py)

The records are the state between steps; a ZeRO 3 step also gathers units and holds bucket gradients,
so the planner's peak for the same layout must fit the cap too (its expert figures equal real steps'
peaks, ``test_moe_plan.py``; their sum with the dense peak is an upper bound). The loss falls in both runs.
"""
from __future__ import annotations


from megazero.arguments import parse_config
from megazero.memory import PlanSpec, plan_memory
from megazero.memory.experts import expert_params
from megazero.run_plan import RunPlan
from tests.helpers.launch import metrics_records

MIB = 2**20
CAP = 40 * MIB  # model state (params + grads + optimizer) per rank
FLAGS = ["--arch", "llama", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "1024",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "3e-3",
         "--log-interval", "1", "--recompute", "none", "--vocab-size", "8000"]
RUNS = {"ep4": ["--ep", "4"], "ep2-zero3": ["--ep", "2", "--zero", "3"]}


def _planned_peak_state(extra: list[str], world: int) -> float:
    """The planner's most model-state bytes on any rank of this layout, at the step's high-water mark."""
    cfg, _ = parse_config(FLAGS + extra)
    plan = plan_memory(PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, world), device="cpu"))
    return max(stage.model_state_bytes for stage in plan.stages)


def test_the_cap_binds_on_one_rank():
    cfg, _ = parse_config(FLAGS)
    assert expert_params(cfg.model) == 3_145_728 and 16 * expert_params(cfg.model) > CAP
    assert _planned_peak_state([], 1) > 1.5 * CAP


def _train(tmp_path, name: str, extra: list[str]) -> list[dict]:
    return metrics_records(tmp_path / f"{name}.jsonl", [*FLAGS, *extra], 4, timeout=600)


def test_experts_over_the_cap_train_under_it_at_ep4_and_at_ep2_with_zero3(tmp_path):
    for name, extra in RUNS.items():
        records = _train(tmp_path, name, extra)
        memory = [r for r in records if r.get("event") == "memory"]
        assert len(memory) == 4, name
        held = {m["rank"]: m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] for m in memory}
        assert max(held.values()) <= CAP, (name, held)
        assert _planned_peak_state(extra, 4) <= CAP, name
        losses = [r["loss"] for r in records if "event" not in r]
        assert len(losses) == 3 and losses[-1] < losses[0], (name, losses)
