"""bench/bench_muon.py's reading of the metrics files (no run: the bench itself launches pretrain_gpt.py)."""
from __future__ import annotations

import statistics

import pytest

from bench.bench_muon import convergence_summary, ns_line, speed_summary, speed_table


def _records(optimizer: str, losses: list[float], ns: float | None) -> list[dict]:
    out = [{"event": "run_start", "run_id": "x"}]
    for i, loss in enumerate(losses, start=1):
        out.append({"iteration": i, "loss": loss, "optimizer": optimizer, "step_time_ms": 100.0 * i,
                    "ns_time_s": None if ns is None else ns * i})
    return out + [{"event": "eval", "iteration": len(losses), "val_loss": 1.5}]


def test_summaries_read_the_tail_the_median_and_the_eval():
    losses = [float(i) for i in range(80, 0, -1)]
    summary = convergence_summary(_records("muon", losses, 0.01))
    assert summary == {"optimizer": "muon", "iterations": 80, "last_mean_loss": statistics.fmean(losses[-50:]),
                       "val_loss": 1.5}
    speed = speed_summary(_records("muon", [1.0] * 6, 0.01))  # iterations 3..6 after the first two
    assert speed["step_s"] == statistics.median([0.3, 0.4, 0.5, 0.6]) and speed["ns_s"] == statistics.median(
        [0.03, 0.04, 0.05, 0.06])
    assert speed_summary(_records("adamw", [1.0] * 6, None))["ns_s"] is None


def test_tables_and_the_ns_ratio():
    rows = {(1, "adamw"): {"step_s": 1.0, "ns_s": None}, (1, "muon"): {"step_s": 1.5, "ns_s": 0.4},
            (2, "adamw"): {"step_s": 0.6, "ns_s": None}, (2, "muon"): {"step_s": 0.8, "ns_s": 0.2}}
    text = speed_table(rows, 6, [])
    assert "| 1 | 1.000 | 1.500 | 1.50 | 0.400 | 26.7% | 0.0, 0.0 |" in text, text
    assert ns_line(rows).endswith("= 0.50 (<= 0.6)")


def test_sizing_a_run_to_minutes():
    from bench.bench_muon import eval_seconds, fit_iterations, schedule_flags
    # 20 minutes, a 4-step probe of 100 s wall at 20 s a step: 20 s start-up, 8 evals of 3 s -> (1200-20-24)//20
    assert fit_iterations(20, 4, 100, 20.0, 8, 3.0) == 57
    assert fit_iterations(20, 4, 100, 20.0) == 59 and fit_iterations(0.1, 4, 100, 20.0) == 2
    assert eval_seconds(0.9) == pytest.approx(3.0)  # EVAL_ITERS forward passes, a third of a step each
    assert schedule_flags("tiny", 500) == [] and schedule_flags("gpt2-small", 57) == ["--lr-warmup-iters", "5"]


def test_the_validation_curve_table():
    from bench.bench_muon import curve_table, eval_curve
    records = _records("muon", [3.0, 2.0], None) + [{"event": "eval", "iteration": 4, "val_loss": 1.25}]
    assert eval_curve(records) == [(2, 1.5), (4, 1.25)]
    text = curve_table({"adamw": [(2, 2.0), (4, 1.0)], "muon": eval_curve(records)})
    assert "| 2 | 2.0000 | 1.5000 |" in text and "| 4 | 1.0000 | 1.2500 |" in text, text
    assert text.endswith("lowest validation loss at the end: adamw (1.0000)")
