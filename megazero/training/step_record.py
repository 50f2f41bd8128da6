"""Bit-exact step records, for changes that must not move a single bit of the numerics.

With ``MEGAZERO_RECORD_STEPS=DIR`` in the environment every ``Trainer`` appends one JSON line per
iteration - the pytest test that ran it (``PYTEST_CURRENT_TEST``, when set), the global rank, the
iteration, and the loss and grad norm as exact hex floats - to ``DIR/<pid>.jsonl``. Record the test
suite before and after a refactor and compare with ``tools/compare_step_records.py``
(torchtitan asks the same of a refactor: bitwise-identical loss and grad norm).
"""
from __future__ import annotations

import json
import os

ENV = "MEGAZERO_RECORD_STEPS"


class StepRecorder:
    """Appends this process's steps to ``DIR/<pid>.jsonl``; does nothing without ``$MEGAZERO_RECORD_STEPS``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        folder = os.environ.get(ENV)
        self.path = os.path.join(folder, f"{os.getpid()}.jsonl") if folder else None
        if folder:
            os.makedirs(folder, exist_ok=True)

    def record(self, iteration: int, loss: float, grad_norm: float | None) -> None:
        if self.path is None:
            return
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        line = {"test": test, "rank": self.rank, "iteration": iteration, "loss": float(loss).hex(),
                "grad_norm": None if grad_norm is None else float(grad_norm).hex()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
