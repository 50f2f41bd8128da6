"""The metrics file and the log line name the optimizer and, for Muon, the step's Newton-Schulz time.

One process through the trainer's own pieces (the real model, optimizer, schedule and metrics sinks): a Muon run's
every record says ``"optimizer": "muon"`` and a positive ``ns_time_s`` no longer than its step, in the JSON-lines
file and in the printed line; an AdamW run says ``"adamw"`` and has ``ns_time_s`` null (it makes no NS call).
"""
from __future__ import annotations

import io
import json

import pytest

from megazero.parallel.state import ParallelState
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.training.metrics import MetricsLog
from megazero.training.parallelize import build_training_model
from megazero.training.trainer import Trainer
from tests.helpers.batches import SyntheticBatches
from tests.helpers.tiny_config import family, tiny_config

ITERS = 3


def _train(optimizer: str, path: str) -> tuple[list[dict], list[dict], str]:
    """(the trainer's records, the metrics file's lines, the printed lines) of a short run."""
    cfg = tiny_config(**family("llama"), optimizer=optimizer, lr=0.02 if optimizer == "muon" else 1e-3,
                      train_iters=ITERS, metrics_file=path)
    pstate = ParallelState.serial()
    plan = RunPlan.resolve(cfg, 1)
    model = build_training_model(cfg, plan, pstate)
    lines = io.StringIO()
    log = MetricsLog(path, enabled=True, stream=lines)
    records = Trainer(cfg, pstate, model, build_schedule(plan), SyntheticBatches(cfg, 0, 1), log).train()
    log.close()
    with open(path) as f:
        written = [json.loads(line) for line in f]
    return [r for r in records if "event" not in r], [r for r in written if "iteration" in r and "event" not in r], \
        lines.getvalue()


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_records_name_the_optimizer_and_muons_ns_time(optimizer, tmp_path):
    records, written, printed = _train(optimizer, str(tmp_path / "metrics.jsonl"))
    assert len(records) == len(written) == ITERS
    iteration_lines = [line for line in printed.splitlines() if line.startswith("iteration")]
    assert len(iteration_lines) == ITERS
    for record, line, text in zip(records, written, iteration_lines):
        assert record["optimizer"] == line["optimizer"] == optimizer
        assert f"| optimizer {optimizer} |" in text, text
        if optimizer == "muon":
            assert 0 < record["ns_time_s"] < record["step_time_ms"] / 1000, record
            assert line["ns_time_s"] == record["ns_time_s"]
            assert f"| NS time (ms) {1000 * record['ns_time_s']:.1f} |" in text, text
        else:
            assert record["ns_time_s"] is None and line["ns_time_s"] is None
            assert "NS time" not in text, text
