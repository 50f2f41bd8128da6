"""--recompute auto: the planner's cheapest recompute that fits the budget, chosen alike on every rank.

Planner level (no launch): as the budget shrinks past each mode's planned peak / (1 - margin) the
choice flips none -> selective -> full, and below full's it stays full and says that nothing fits;
a bad --memory-budget-gb is one line naming the flag; the presets default to auto; --dry-run plans
the mode a run would pick. One pretrain_gpt.py launch (dp 2) with a budget between selective's and
none's peaks: rank 0 prints the one line, choosing selective; rank 1 prints nothing of it.
"""
from __future__ import annotations

import glob
import os

import pytest
import yaml

from megazero.arguments import parse_config
from megazero.config import Config, ConfigError
from megazero.memory import GIB, PlanSpec, format_plan, plan_for_run, plan_memory
from megazero.memory.recompute_choice import MARGIN, choose_recompute, resolve_recompute
from megazero.run_plan import RunPlan
from tests.helpers.launch import ROOT, launch

MODES = ("none", "selective", "full")


def _peaks(cfg: Config, world: int, device: str) -> dict[str, float]:
    run = RunPlan.resolve(cfg, world)
    return {m: plan_memory(PlanSpec.from_plan(cfg.updated(recompute=m), run, device)).peak.total_bytes
            for m in MODES}


def _budget_between(low: float, high: float) -> float:
    """A budget whose usable part lies strictly between two planned peaks."""
    return (low + high) / 2 / (1 - MARGIN)


def test_choice_flips_as_the_budget_shrinks():
    cfg = Config.from_flat({"arch": "llama", "num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
                            "num_query_groups": 4, "seq_length": 4096, "vocab_size": 32000, "micro_batch_size": 2,
                            "global_batch_size": 16, "bf16": True, "zero": 1, "recompute": "auto"})
    peaks = _peaks(cfg, 8, "cuda")
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks
    run = RunPlan.resolve(cfg, 8)
    budgets = {"none": 1.01 * peaks["none"] / (1 - MARGIN),
               "selective": _budget_between(peaks["selective"], peaks["none"]),
               "full": _budget_between(peaks["full"], peaks["selective"])}
    for want, budget in budgets.items():
        choice = choose_recompute(cfg, run, "cuda", budget, "test")
        assert choice.mode == want, choice.describe()
        assert [m for m, _ in choice.tried] == list(MODES[: MODES.index(want) + 1])
        assert f"chose {want} (it fits)" in choice.describe()
    starved = choose_recompute(cfg, run, "cuda", peaks["full"], "test")  # 90% of full's peak: nothing fits
    assert starved.mode == "full" and "nothing fits" in starved.describe()
    # the flag path: --memory-budget-gb replaces what the device reports, and the config comes back resolved
    resolved, choice = resolve_recompute(cfg.updated(memory_budget_gb=budgets["selective"] / GIB), run, "cuda")
    assert resolved.training.recompute == "selective" and "--memory-budget-gb" in choice.describe()
    assert resolve_recompute(cfg.updated(recompute="full"), run, "cuda") == (cfg.updated(recompute="full"), None)


@pytest.mark.parametrize("flags,words", [
    (["--recompute", "auto", "--memory-budget-gb", "0"], "--memory-budget-gb must be in (0, "),
    (["--recompute", "auto", "--memory-budget-gb", "-3"], "--memory-budget-gb must be in (0, "),
    (["--recompute", "auto", "--memory-budget-gb", "inf"], "--memory-budget-gb must be in (0, "),
    (["--memory-budget-gb", "40"], "only applies with --recompute auto"),
])
def test_bad_budget_is_one_line(flags, words):
    with pytest.raises(ConfigError) as err:
        parse_config(flags)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_presets_default_to_auto_and_dry_run_resolves_it():
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            assert yaml.safe_load(f)["recompute"] == "auto", path
    cfg, _ = parse_config(["--config", os.path.join(ROOT, "configs", "llama-1b.yaml"), "--memory-budget-gb", "1000"])
    assert "recompute none" in format_plan(plan_for_run(cfg, 8))
    assert "recompute full" in format_plan(plan_for_run(cfg.updated(memory_budget_gb=1.0), 8))


def test_pretrain_prints_the_choice_once(tmp_path):
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--vocab-size", "8000", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
             "--log-interval", "1", "--device", "cpu", "--recompute", "auto"]
    cfg, _ = parse_config(flags)
    peaks = _peaks(cfg, 2, "cpu")
    budget = repr(_budget_between(peaks["selective"], peaks["none"]) / GIB)
    results = launch("pretrain_gpt.py", [*flags, "--memory-budget-gb", budget], 2)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank}:\n{r.stderr[-3000:]}"
    lines = [line for line in results[0].stdout.splitlines() if "--recompute auto" in line]
    assert len(lines) == 1 and "chose selective (it fits)" in lines[0], results[0].stdout
    assert "--recompute auto" not in results[1].stdout
