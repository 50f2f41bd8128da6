"""Where a run's records go besides the console: a JSON-lines file and TensorBoard event files.

``open_sinks`` returns only the sinks the run asked for, so ``MetricsLog`` hands every record to
each of them without asking which exist; a run with neither flag has an empty list.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator, Protocol

import yaml


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


PERF_FIELDS = {"step_time_ms", "tokens_per_sec", "tflops_per_device", "mfu", "elapsed_s", "eta_s",
               "bubble_fraction", "ns_time_s"}
MEMORY_FIELDS = {"peak_memory_bytes"}


def tag_group(record: dict[str, Any], field: str) -> str:
    """The TensorBoard section a top-level field is shown in: ``val`` (evaluations), ``moe``, ``comm`` (bytes
    sent, --log-timers waits), ``perf`` (time, throughput, the bubble), ``memory``, else ``train``."""
    if record.get("event") == "eval":
        return "val"
    if field.startswith("moe_"):
        return "moe"
    if field.startswith("comm_"):
        return "comm"
    return "perf" if field in PERF_FIELDS else "memory" if field in MEMORY_FIELDS else "train"


def config_markdown(record: dict[str, Any]) -> str:
    """A run_start record as TensorBoard's text plugin shows it: the run id, then the configuration as YAML
    (a Markdown code block: four spaces before each line)."""
    text = yaml.safe_dump({"run_id": record["run_id"], "continues": record["continues"],
                           "start_iteration": record["start_iteration"], "layout": record["layout"],
                           **record["config"]}, sort_keys=False)
    return "\n".join("    " + line for line in text.splitlines())


class TensorBoardSink:
    """Writes each iteration's and evaluation's numeric fields as TensorBoard scalars at that iteration, and
    each run start's configuration as text (tag ``config``, at the iteration it starts from).

    Tags are ``<group>/<field>`` (``tag_group``; nested fields ``<group>/<outer>/<inner>``), the field named as
    in the metrics file, so the two agree line for line and TensorBoard shows one section per group;
    TensorBoard stores them as float32, and a non-finite loss stays NaN/inf there (the metrics file writes
    it as null).
    """

    def __init__(self, directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: only runs that ask pay tensorboard's import

        self.writer = SummaryWriter(log_dir=directory)

    def write(self, record: dict[str, Any]) -> None:
        if record.get("event") == "run_start":
            self.writer.add_text("config", config_markdown(record), global_step=record["start_iteration"])
        elif "iteration" in record:  # (the start-up memory records belong to no step)
            for tag, value in numeric_fields(record):
                group = tag_group(record, tag.split("/", 1)[0])
                self.writer.add_scalar(f"{group}/{tag}", value, global_step=record["iteration"])
        else:
            return
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
