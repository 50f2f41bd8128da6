"""Which kernel ``scaled_dot_product_attention`` runs for this model, said once at start-up.

The attention core calls SDPA and lets PyTorch pick the kernel: flash attention on CPU (fp32, bf16,
fp64, GQA included) and flash / cuDNN / memory-efficient on CUDA, falling back to the math kernel
(which holds the whole S x S score matrix) when an input rules the fused ones out - attention
dropout on CPU, an unsupported head dim or dtype on GPU. A run that silently lands on the math
kernel is slower and uses far more memory, so the choice is printed, asked of PyTorch's own
dispatcher with tensors shaped like one micro-batch's.
"""
from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from ..config import ModelConfig
from ..dtypes import DTYPE_NAMES


def sdpa_backend(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int,
                 training: bool = True) -> str:
    """The SDPA backend PyTorch's dispatcher picks for causal attention of this shape ("FLASH_ATTENTION", ...)."""
    q = torch.zeros(1, heads, 8, cfg.head_dim, dtype=dtype, device=device)
    kv = torch.zeros(1, kv_heads, 8, cfg.head_dim, dtype=dtype, device=device)
    dropout = cfg.attention_dropout if training else 0.0
    try:
        choice = torch._fused_sdp_choice(q, kv, kv, dropout_p=dropout, is_causal=True, enable_gqa=heads != kv_heads)
        return SDPBackend(choice).name
    except (AttributeError, RuntimeError, ValueError):  # a torch without the private helper, or no viable kernel
        return "unknown"


def describe_attention(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: int, cp: int,
                       cp_comm_type: str) -> str:
    """One line: the kernel the attention core runs, and what context parallelism does around it."""
    heads, kv_heads = cfg.num_attention_heads // tp, cfg.query_groups // tp
    backend = sdpa_backend(cfg, dtype, device, heads, kv_heads)
    dtype_name = DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))
    line = f"attention: SDPA {backend} on {device.type} ({dtype_name}, {heads} heads / {kv_heads} kv heads per rank)"
    if backend == "MATH":
        line += "; the math kernel holds the S x S scores" + (" (attention dropout rules out flash)"
                                                               if cfg.attention_dropout > 0 else "")
    if cp > 1:
        where = "per ring block: torch's flash op on CPU, the math kernel on CUDA" if "p2p" in cp_comm_type \
            else "whole-sequence SDPA on head shards"
        line += f"; --cp {cp} --cp-comm-type {cp_comm_type}: {where}"
    return line
