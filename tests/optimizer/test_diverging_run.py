"""A diverging fp32 run through pretrain_gpt.py skips its NaN steps, then stops with one clear line.

lr 1e8 makes the first update so large that every later forward is NaN. Each such
step must be skipped (logged with the ``skipped`` flag and counted as a NaN
iteration), and after ``--max-skipped-steps`` of them in a row every rank must
exit with status 2 and the one-line error naming the flag.
"""
from __future__ import annotations

import json
import math

from tests.helpers.launch import launch

LIMIT = 3
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "30", "--log-interval", "10",
         "--lr", "1e8", "--lr-warmup-iters", "0", "--device", "cpu", "--max-skipped-steps", str(LIMIT)]


def _not_json(constant: str):
    raise AssertionError(f"the metrics file holds {constant}, which is not JSON (RFC 8259)")


def test_huge_lr_run_skips_then_stops(tmp_path):
    metrics = tmp_path / "m.jsonl"
    results = launch("pretrain_gpt.py", [*FLAGS, "--metrics-file", str(metrics)], 2, timeout=300)
    records = [json.loads(line, parse_constant=_not_json) for line in metrics.read_text().splitlines()]
    records = [r for r in records if "iteration" in r and "event" not in r]
    last = records[-1]
    for rank, r in enumerate(results):
        errors = [line for line in r.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
        assert r.returncode == 2 and len(errors) == 1, f"rank {rank} rc {r.returncode}:\n{r.stderr[-3000:]}"
        assert (f"stopped at iteration {last['iteration']}: {LIMIT} consecutive" in errors[0]
                and "--max-skipped-steps" in errors[0] and "--lr" in errors[0]), errors[0]
    # every NaN iteration is logged despite --log-interval 10; the last LIMIT of them were skipped
    tail = records[-LIMIT:]
    assert [r["iteration"] for r in tail] == list(range(last["iteration"] - LIMIT + 1, last["iteration"] + 1))
    # strict JSON: a non-finite loss is null, and <key>_nonfinite says which value it was
    assert all(r["skipped"] and r["loss"] is None and r["loss_nonfinite"] in ("nan", "inf", "-inf")
               for r in tail), tail
    assert all(r["grad_norm"] is None or math.isfinite(r["grad_norm"]) for r in records), records
    assert last["skipped_iterations"] == last["nan_iterations"] >= LIMIT, last
    assert last["iteration"] < 30, last
