"""Where a run's records go besides the console: a JSON-lines file and TensorBoard event files.

``open_sinks`` returns only the sinks the run asked for, so ``MetricsLog`` hands every record to
each of them without asking which exist; a run with neither flag has an empty list.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator, Protocol


class MetricSink(Protocol):
    """Takes every record the logging rank produces (iterations, evaluations, start-up memory)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as strict JSON allows: a NaN or infinite number becomes null, and ``<key>_nonfinite``
    says which it was ("nan", "inf", "-inf"), so a skipped step's line still parses everywhere."""
    safe: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            value = json_safe(value)
        elif isinstance(value, float) and not math.isfinite(value):
            safe[key], safe[f"{key}_nonfinite"] = None, str(value)
            continue
        safe[key] = value
    return safe


class JsonLinesSink:
    """Appends one strict-JSON object per record to ``path``, flushed at once so a crash loses nothing."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def numeric_fields(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every number in ``record`` (booleans as 0/1, nested dicts as ``outer/inner``);
    None, strings and the step itself (``iteration``) are left out."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from numeric_fields(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not (prefix == "" and key == "iteration"):
            yield f"{prefix}{key}", float(value)


class TensorBoardSink:
    """Writes each iteration's and evaluation's numeric fields as TensorBoard scalars at that iteration.

    Tags are the metrics file's field names, so the two agree line for line; TensorBoard stores them as
    float32, and a non-finite loss stays NaN/inf there (the metrics file writes it as null).
    """

    def __init__(self, directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: only runs that ask pay tensorboard's import

        self.writer = SummaryWriter(log_dir=directory)

    def write(self, record: dict[str, Any]) -> None:
        if "iteration" not in record:  # the start-up memory records belong to no step
            return
        for tag, value in numeric_fields(record):
            self.writer.add_scalar(tag, value, global_step=record["iteration"])
        self.writer.flush()  # as the metrics file does: a live TensorBoard sees each step, a crash loses none

    def close(self) -> None:
        self.writer.close()


def open_sinks(metrics_file: str | None, tensorboard_dir: str | None) -> list[MetricSink]:
    """The sinks a run asked for (``--metrics-file``, ``--tensorboard-dir``), opened."""
    sinks: list[MetricSink] = []
    if metrics_file:
        sinks.append(JsonLinesSink(metrics_file))
    if tensorboard_dir:
        sinks.append(TensorBoardSink(tensorboard_dir))
    return sinks
