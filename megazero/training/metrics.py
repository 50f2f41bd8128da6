"""What a run shows: one human line per logged iteration and one JSON object per line in a file."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
from typing import Any, TextIO

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


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


class MetricsLog:
    """Appends JSON lines to ``path`` (when given) and prints human lines, on the logging rank only."""

    def __init__(self, path: str | None, enabled: bool, stream: TextIO = sys.stdout) -> None:
        self.enabled, self.stream = enabled, stream
        self.file = None
        if enabled and path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a")

    def record(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self.file.flush()

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def format_iteration(r: dict[str, Any]) -> str:
    """Megatron-style line: `iteration 10/100 | consumed samples ... | lm loss ... | ...`."""
    parts = [
        f"iteration {r['iteration']:>6d}/{r['train_iters']:<6d}",
        f"consumed samples {r['consumed_samples']:>8d}",
        f"elapsed time per iteration (ms) {r['step_time_ms']:.1f}",
        f"learning rate {r['lr']:.3E}",
        f"lm loss {r['loss']:.6E}",
        f"grad norm {r['grad_norm']:.3f}",
    ]
    if r.get("loss_scale") is not None:
        parts.append(f"loss scale {r['loss_scale']:.1f}")
    if r.get("skipped"):
        parts.append("step skipped")  # this iteration's update was not applied (see StepResult)
    parts.append(f"skipped iterations {r.get('skipped_iterations', 0)}")
    parts.append(f"nan iterations {r.get('nan_iterations', 0)}")
    parts.append(f"tokens/s {r['tokens_per_sec']:.0f}")
    parts.append(f"TFLOP/s/device {r['tflops_per_device']:.3f}")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts.append(f"peak mem {r['peak_memory_bytes'] / 2**20:.0f} MiB")
    if "comm_wait_s" in r:  # --log-timers
        waits = " ".join(f"{axis} {1000 * s:.1f}" for axis, s in r["comm_wait_s"].items() if axis != "world")
        parts.append(f"comm wait ms {waits or '-'}")
    if r.get("bubble_fraction") is not None:
        parts.append(f"bubble {r['bubble_fraction']:.2f}")
    return " | ".join(parts)


def format_eval(r: dict[str, Any]) -> str:
    return (f"validation loss at iteration {r['iteration']} | lm loss value: {r['val_loss']:.6E} | "
            f"lm loss PPL: {r['val_ppl']:.6E}")
