"""tools/plan_memory.py plans for a cluster from a machine without its GPU (the presets' --recompute auto).

A laptop plans for a cluster, so the planner never asks this machine's device: with --gpu-memory (or
--memory-budget-gb) it plans the mode a run with that much memory chooses - the same mode as the
run's own path (``plan_for_run`` with --memory-budget-gb) - and says the budget and where it came
from; without either it plans every mode and says so. --zero-stages parses each stage as --zero, so
a flag only ZeRO 3 takes is valid with ``--zero-stages 3`` and refused in one line with stage 1.
"""
from __future__ import annotations

import json

import pytest

from megazero.arguments import parse_config
from megazero.memory import GIB, plan_for_run, planned_world
from megazero.memory import recompute_choice
from megazero.config import RECOMPUTE_MODES as MODES
from megazero.memory.recompute_choice import MARGIN
from tests.helpers.tool_module import load_tool

TINY = ["--config", "configs/tiny.yaml", "--vocab-size", "8000", "--tp", "2", "--dp", "2"]  # recompute: auto


@pytest.fixture
def tool(monkeypatch):
    """The planner, with this machine's device made unreadable: a plan that asks it fails."""
    def no_device(*args, **kwargs):
        raise AssertionError("the planner asked this machine's device")

    monkeypatch.setattr(recompute_choice, "_mem_available", no_device)
    monkeypatch.setattr(recompute_choice.torch.cuda, "is_available", no_device)
    monkeypatch.setattr(recompute_choice.torch.cuda, "mem_get_info", no_device)
    return load_tool("plan_memory")


def _run_peaks() -> dict[str, float]:
    """Each mode's planned peak per rank (GiB), by the run's own path."""
    cfg, _ = parse_config(TINY[:-2])
    world = planned_world(cfg, 2)
    return {m: plan_for_run(cfg.updated(recompute=m), world).peak.total_bytes / GIB for m in MODES}


def test_without_a_budget_every_mode_is_planned_and_said(tool):
    code, text = tool.report(TINY)
    lines = text.splitlines()
    assert code == 0
    assert lines[0].startswith("--recompute auto: no memory budget given (--gpu-memory GB or --memory-budget-gb GB)")
    rows = [line.split() for line in lines[2:]]
    assert [r[7] for r in rows] == list(MODES), text
    peaks = _run_peaks()
    assert [float(r[-1]) for r in rows] == [round(peaks[m], 2) for m in MODES], (text, peaks)
    planned = json.loads(tool.report(TINY + ["--json"])[1])
    assert [p["layout"]["recompute"] for p in planned] == list(MODES)
    assert all(p["recompute_auto"] == lines[0] for p in planned)


def test_gpu_memory_is_the_budget_a_run_would_have(tool):
    peaks = _run_peaks()
    assert peaks["none"] > peaks["full"], peaks
    between = (peaks["none"] + peaks["full"]) / 2 / (1 - MARGIN)  # full fits, none does not
    for gib, want in ((1.01 * peaks["none"] / (1 - MARGIN), "none"), (between, "full")):
        code, text = tool.report(TINY + ["--gpu-memory", str(gib)])
        cfg, _ = parse_config(TINY[:-2] + ["--memory-budget-gb", str(gib)])
        run_mode = plan_for_run(cfg, planned_world(cfg, 2)).spec.cfg.training.recompute
        assert code == 0 and run_mode == want
        assert f"--recompute auto chose {want} " in text and "from --gpu-memory" in text, text
        assert f"recompute {want}," in text  # the stage table is of that mode
    code, text = tool.report(TINY + ["--gpu-memory", str(between), "--memory-budget-gb", "1000"])
    assert "chose none" in text and "budget 1000.00 GiB from --memory-budget-gb" in text, text


def test_zero_stages_parse_each_stage(tool):
    code, text = tool.report(TINY + ["--no-reshard-after-forward", "--zero-stages", "3", "--gpu-memory", "1"])
    assert code == 0 and "chose none" in text and len(text.splitlines()) == 3, text
    with pytest.raises(ValueError) as err:
        tool.report(TINY + ["--no-reshard-after-forward", "--zero-stages", "1", "3"])
    assert "--no-reshard-after-forward only applies with --zero 3 (here --zero 1)" in str(err.value)
    assert "\n" not in str(err.value)


def test_search_keeps_its_80_gib_default(tool):
    code, text = tool.report(TINY[:4] + ["--gpus", "4", "--top", "1"])
    assert code == 0 and "on 4 GPUs x 80 GiB" in text, text
