"""bench/bench_muon.py's reading of the metrics files (no run: the bench itself launches pretrain_gpt.py)."""
from __future__ import annotations

import statistics

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
