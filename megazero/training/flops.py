"""Model FLOPs per token, and the achieved TFLOP/s and MFU they give.

We count matrix-multiply FLOPs only (2 per multiply-add), as Megatron-LM and
the PaLM paper do; norms, softmax and element-wise ops are noise at scale.
Per token and layer, in the forward pass (h hidden, n heads, g query groups,
d = h/n head dim, f MLP width, s sequence length, V vocabulary):

    QKV projection       2 * h * (n + 2g) * d
    scores  Q K^T        2 * s * n * d          (the full s x s square: the
    mix     P V          2 * s * n * d           convention Megatron uses too)
    output projection    2 * n * d * h
    MLP                  2 * 2 * h * f  (gpt2)  or  2 * 3 * h * f  (llama, SwiGLU)

plus the output head, 2 * h * V, once per token. Backward costs twice the
forward. Recomputation adds forward work again: ``full`` re-runs the whole
forward of the recomputed layers, ``selective`` only the attention core
(scores and mix). Achieved TFLOP/s per device = FLOPs per token x tokens per
step / step time / number of devices; MFU divides that by the device's peak.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig

# Dense bf16 peak TFLOP/s by device name fragment (vendor datasheets, without sparsity).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "V100": 125.0}


def layer_forward_flops(cfg: ModelConfig) -> tuple[float, float]:
    """(whole layer, attention core only) forward FLOPs per token of one transformer layer."""
    h, n, g, d, f, s = (cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim,
                        cfg.ffn_size, cfg.seq_length)
    core = 2 * s * n * d * 2
    mlp_mats = 3 if cfg.arch == "llama" else 2
    total = 2 * h * (n + 2 * g) * d + core + 2 * n * d * h + 2 * mlp_mats * h * f
    return float(total), float(core)


def flops_per_token(cfg: ModelConfig, recompute: str = "none", recompute_num_layers: int | None = None) -> float:
    """Training FLOPs (forward + backward + recomputation) per token."""
    assert cfg.vocab_size is not None
    layer, core = layer_forward_flops(cfg)
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    forward = cfg.num_layers * layer + head
    extra = 0.0
    if recompute == "full":
        extra = (recompute_num_layers or cfg.num_layers) * layer
    elif recompute == "selective":
        extra = cfg.num_layers * core
    return 3.0 * forward + extra


def device_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of a known GPU, None elsewhere (no MFU is reported then)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def achieved_tflops(flops_token: float, tokens_per_step: int, step_seconds: float, devices: int) -> float:
    return flops_token * tokens_per_step / step_seconds / devices / 1e12
