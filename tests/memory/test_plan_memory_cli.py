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
from tests.helpers.launch import ROOT, run_python
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
    planned = json.loads(tool.report(TINY + ["--json"])[1])["layouts"]
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


SEARCH = TINY[:4] + ["--gpus", "8", "--top", "1000"]  # configs/tiny.yaml: 4 layers, 4 heads


def _searched(tool, *flags: str) -> list[dict]:
    code, text = tool.report([*SEARCH, *flags, "--json"])
    record = json.loads(text)
    assert code == 0 and record["mode"] == "search", text[:300]
    return [layout["layout"] for layout in record["layouts"]]


def test_the_search_holds_the_degrees_given(tool):
    """--tp/--cp/--pp/--dp/--ep/--etp were ignored by --gpus without a word: now every listed layout has them,
    and the rest (the other degrees, ZeRO, micro-batch, recompute) is still searched."""
    free = _searched(tool)
    assert {(lay["tp"], lay["pp"]) for lay in free} > {(2, 2)}  # the search alone lists other layouts too
    for flags, axes in ((["--tp", "2", "--pp", "2"], {"tp": 2, "pp": 2}), (["--cp", "2"], {"cp": 2}),
                        (["--dp", "4"], {"dp": 4}), (["--pp", "4", "--dp", "2"], {"pp": 4, "dp": 2})):
        held = _searched(tool, *flags)
        expected = [lay for lay in free if all(lay[axis] == value for axis, value in axes.items())]
        assert held and sorted(map(json.dumps, held)) == sorted(map(json.dumps, expected)), flags
    moe = ["--config", "configs/moe-tiny.yaml", "--vocab-size", "8000", "--gpus", "4", "--top", "1000"]
    code, text = tool.report([*moe, "--ep", "2", "--etp", "1", "--json"])
    layouts = [layout["layout"] for layout in json.loads(text)["layouts"]]
    assert code == 0 and layouts and all((lay["ep"], lay["etp"]) == (2, 1) for lay in layouts)
    assert json.loads(text)["held"] == {"ep": 2, "etp": 1}


def test_the_held_degrees_are_said_and_what_cannot_fit_is_one_line(tool, capsys):
    """As a user runs it: the table says what it held; degrees the GPUs cannot take are refused before searching."""
    held = run_python(["tools/plan_memory.py", *SEARCH[:4], "--gpus", "8", "--top", "3", "--tp", "2", "--pp", "2"],
                      timeout=120)
    assert held.returncode == 0 and held.stdout.splitlines()[1] == (
        "held as given: --tp 2 --pp 2; every listed layout has them"), held.stdout + held.stderr
    rows = [line.split() for line in held.stdout.splitlines()[3:]]
    assert len(rows) == 3 and all(row[-13:-10] == ["2", "1", "2"] for row in rows), held.stdout
    for flags, line in (
            (["--tp", "3"], "--tp 3 (held as given) does not divide --gpus 8; pick degrees whose product divides "
                            "the GPUs, or drop them to search."),
            (["--tp", "2", "--pp", "2", "--dp", "4"], "--tp 2 x --pp 2 x --dp 4 = 16 (held as given) does not divide "
                                                      "--gpus 8; pick degrees whose product divides the GPUs, or drop "
                                                      "them to search."),
            (["--tp", "2", "--cp", "1", "--pp", "2", "--dp", "1"],
             "--tp 2 x --cp 1 x --pp 2 x --dp 1 = 4 (held as given) does not equal --gpus 8; pick degrees whose "
             "product is the GPUs, or drop them to search."),
            (["--tp", "4", "--gpus-per-node", "2"], "--tp 4 is more than the 2 GPUs of a node (--gpus-per-node 2, "
                                                    "--gpus 8); the search keeps tp inside a node: lower --tp or "
                                                    "drop it to search.")):
        capsys.readouterr()
        assert tool.main([*SEARCH[:4], "--gpus", "8", *flags]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.strip() == f"plan_memory.py: error: {line}", (flags, out, err)


def test_json_is_one_shape_in_every_mode(tool):
    """--json was one object for a single plan and a list for rows and searches: now always
    {"mode": "plan" | "search", "layouts": [...]}, each layout one plan's object."""
    shapes = {"single": TINY + ["--gpu-memory", "80"], "modes": TINY, "stages": TINY + ["--zero-stages", "1", "2"],
              "search": SEARCH[:4] + ["--gpus", "4", "--top", "2"]}
    for name, argv in shapes.items():
        record = json.loads(tool.report(argv + ["--json"])[1])
        assert set(record) == ({"mode", "layouts", "held"} if name == "search" else {"mode", "layouts"}), name
        assert record["mode"] == ("search" if name == "search" else "plan")
        assert isinstance(record["layouts"], list) and record["layouts"], name
        assert all({"total_bytes", "layout", "stages"} <= set(layout) for layout in record["layouts"]), name
    assert len(json.loads(tool.report(shapes["single"] + ["--json"])[1])["layouts"]) == 1
    assert len(json.loads(tool.report(shapes["modes"] + ["--json"])[1])["layouts"]) == len(MODES)


def test_a_degree_a_preset_gives_is_held_too(tool, tmp_path):
    preset = tmp_path / "tiny_pp2.yaml"
    preset.write_text(open(f"{ROOT}/configs/tiny.yaml").read() + "\npipeline_model_parallel_size: 2\n")
    code, text = tool.report(["--config", str(preset), "--vocab-size", "8000", "--gpus", "8", "--top", "1000",
                              "--json"])
    record = json.loads(text)
    assert code == 0 and record["held"] == {"pp": 2} and record["layouts"], text[:300]
    assert all(layout["layout"]["pp"] == 2 for layout in record["layouts"])
