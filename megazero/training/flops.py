"""Achieved TFLOP/s and MFU from the model's FLOPs per token (``megazero.model.flops``; for an MoE model
the active parameters: router, k routed experts and the shared expert per token, not all E experts).

Achieved TFLOP/s per device = FLOPs per token x tokens per step / step time /
number of devices; MFU divides that by the device's peak.
"""
from __future__ import annotations

import torch


# Dense bf16 peak TFLOP/s by device name fragment (vendor datasheets, without sparsity).
# First match wins, so "L40S" comes before "L4".
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0,
                    "V100": 125.0}


def device_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of a known GPU, None elsewhere (no MFU is reported then)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def achieved_tflops(flops_token: float, tokens_per_step: int, step_seconds: float, devices: int) -> float:
    return flops_token * tokens_per_step / step_seconds / devices / 1e12
