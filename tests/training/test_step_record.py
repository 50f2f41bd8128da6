"""Step records are bit-exact and the comparison tool tells identical runs from changed ones."""
from __future__ import annotations

import json
import os

from megazero.parallel.state import ParallelState
from tests.helpers.launch import run_python
from tests.helpers.optimizer_harness import make_cfg, train


def record(folder, monkeypatch, lr: float) -> None:
    monkeypatch.setenv("MEGAZERO_RECORD_STEPS", str(folder))
    cfg = make_cfg(iters=3).updated(lr=lr)
    run = train(ParallelState.serial(), cfg)
    lines = [json.loads(x) for f in os.listdir(folder) for x in open(os.path.join(folder, f))]
    assert [float.fromhex(x["loss"]) for x in lines] == [r["loss"] for r in run["records"]]


def compare(a, b) -> int:
    return run_python(["tools/compare_step_records.py", str(a), str(b)]).returncode


def test_identical_runs_match_and_a_changed_one_does_not(tmp_path, monkeypatch):
    record(tmp_path / "a", monkeypatch, 1e-3)
    record(tmp_path / "b", monkeypatch, 1e-3)
    record(tmp_path / "c", monkeypatch, 1.0001e-3)
    assert compare(tmp_path / "a", tmp_path / "b") == 0
    assert compare(tmp_path / "a", tmp_path / "c") == 1
