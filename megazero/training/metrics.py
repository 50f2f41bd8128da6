"""What a run shows: one human line per logged iteration, and each record to the metrics file and TensorBoard."""
from __future__ import annotations

import resource
import sys
from typing import Any, TextIO

import torch

from ..optimizer.muon import NS_CLOCK
from .metric_sinks import open_sinks
from .progress import clock_time


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class OptimizerFields:
    """A record's optimizer fields: ``optimizer`` (--optimizer) and ``ns_time_s``, the seconds of the step's
    Newton-Schulz calls on this rank (Muon; None for AdamW, which has none). ``start_step`` at each step's
    start drops what came before (the steps not logged, evaluations), so the figure is one step's."""

    def __init__(self, optimizer: str) -> None:
        self.optimizer = optimizer

    def start_step(self) -> None:
        NS_CLOCK.take()

    def fields(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "ns_time_s": NS_CLOCK.take() if self.optimizer == "muon" else None}


class MetricsLog:
    """Hands each record to the run's sinks (metrics file, TensorBoard) and prints human lines, on the
    logging rank only."""

    def __init__(self, path: str | None, enabled: bool, stream: TextIO = sys.stdout, *,
                 tensorboard_dir: str | None = None) -> None:
        self.enabled, self.stream = enabled, stream
        self.sinks = open_sinks(path, tensorboard_dir) if enabled else []

    def record(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def _is_mtp(key: str) -> bool:
    """``mtp_<k>_loss``: depth k's multi-token prediction loss (``training/mtp_step.py``)."""
    return key.startswith("mtp_") and key.endswith("_loss")


def format_iteration(r: dict[str, Any]) -> str:
    """Megatron-style line: `iteration 10/100 | consumed samples ... | lm loss ... | ...`."""
    parts = [
        f"iteration {r['iteration']:>6d}/{r['train_iters']:<6d}",
        *([f"elapsed {clock_time(r['elapsed_s'])} | ETA {clock_time(r['eta_s'])}"] if "eta_s" in r else []),
        f"consumed samples {r['consumed_samples']:>8d}",
        f"elapsed time per iteration (ms) {r['step_time_ms']:.1f}",
        f"learning rate {r['lr']:.3E}",
        f"lm loss {r['loss']:.6E}",
        *[f"mtp {k} loss {r[f'mtp_{k}_loss']:.6E}" for k in range(1, 1 + sum(1 for key in r if _is_mtp(key)))],
        f"grad norm {r['grad_norm']:.3f}",
    ]
    if "optimizer" in r:
        parts.append(f"optimizer {r['optimizer']}")
    if r.get("ns_time_s") is not None:
        parts.append(f"NS time (ms) {1000 * r['ns_time_s']:.1f}")
    if "qk_clip_count" in r:  # --qk-clip-threshold (optimizer/qk_clip.py); max_logit is null on a skipped step
        seen = [v for v in r.get("max_logit") or () if v is not None]
        parts += [f"max attention logit {max(seen):.3f}"] if seen else []
        parts.append(f"qk-clipped heads {r['qk_clip_count']}")
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
    if "moe_imbalance" in r:
        parts.append(format_moe(r))
    return " | ".join(parts)


MOE_LOSS_LABELS = {"moe_aux_loss": "aux", "moe_seq_aux_loss": "seq aux", "moe_z_loss": "z"}


def format_moe(r: dict[str, Any]) -> str:
    """``moe aux 1.003E+00 z 2.104E+00 imbalance 0.042 (layer 3)``: the balance losses (mean over the MoE layers)
    and the worst layer's max/mean - 1 of tokens per expert; the metrics file has every layer's."""
    losses = [f"{label} {r[key]:.3E}" for key, label in MOE_LOSS_LABELS.items() if key in r]
    return " ".join(["moe", *losses, f"imbalance {r['moe_imbalance']:.3f} (layer {r['moe_imbalance_layer']})"])


def format_eval(r: dict[str, Any]) -> str:
    """Megatron's validation line; with MTP, each depth's loss after the LM's (``val_mtp_<k>_loss``)."""
    depths = sum(1 for key in r if key.startswith("val_") and _is_mtp(key[len("val_"):]))
    return " | ".join([f"validation loss at iteration {r['iteration']}", f"lm loss value: {r['val_loss']:.6E}",
                       f"lm loss PPL: {r['val_ppl']:.6E}",
                       *[f"mtp {k} loss value: {r[f'val_mtp_{k}_loss']:.6E}" for k in range(1, depths + 1)]])
