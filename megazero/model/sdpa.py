"""The attention core both attention modules run, and which SDPA kernel it lands on, said once at start-up.

``core_attention`` is the one core of ``transformer.Attention`` and ``mla.MLA`` (it lives here, below both,
because transformer.py imports mla.py): softmax(QK^T / sqrt(d)) V, causal, per document with ``bounds``,
around the CP ring or all-to-all under --cp, and the per-head max logit into the layer's QK-clip sink.

The attention core calls SDPA and lets PyTorch pick the kernel: flash attention on CPU (fp32, bf16,
fp64, GQA included) and flash / cuDNN / memory-efficient on CUDA, falling back to the math kernel
(which holds the whole S x S score matrix) when an input rules the fused ones out - attention
dropout on CPU, an unsupported head dim or dtype on GPU. A run that silently lands on the math
kernel is slower and uses far more memory, so the choice is printed, asked of PyTorch's own
dispatcher with tensors shaped like one micro-batch's.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ..config import ModelConfig
from ..context_parallel.attention import cp_attention
from ..context_parallel.doc_blocks import Bounds, document_attention
from ..context_parallel.logit_max import whole_sequence_logit_max
from ..dtypes import DTYPE_NAMES


def core_attention(layer: Any, q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor,
                   bounds: Bounds | None = None) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V of ``layer`` (an ``Attention`` or ``MLA``: its cfg, ctx, layer_id, training
    and logit_max), causal (within each document when ``bounds`` is given); GQA when k has fewer heads than q.
    Dropout draws from the layer's per-TP-rank stream (heads are split). QK-clip: in training the attended
    pairs' max logit per head goes into ``layer.logit_max``."""
    sink = layer.logit_max if layer.training else None
    if layer.ctx.cp.active:  # K/V around the CP ring, or all-to-all to head shards (no dropout: refused)
        return cp_attention(q_bnsd, k_bgsd, v_bgsd, layer.ctx.cp, bounds, sink)
    if sink is not None:
        whole_sequence_logit_max(sink, q_bnsd, k_bgsd, bounds)
    dropout = layer.cfg.attention_dropout if layer.training else 0.0
    # p = 0 draws nothing: skip swapping the stream's RNG state in and out (4 state copies per layer)
    rng = layer.ctx.fork_rng(layer.layer_id, tensor_parallel=True) if dropout > 0 else contextlib.nullcontext()
    with rng:
        if bounds is not None:  # one fused causal call per document: nothing across documents is computed
            return document_attention(q_bnsd, k_bgsd, v_bgsd, bounds, dropout_p=dropout)
        return F.scaled_dot_product_attention(q_bnsd, k_bgsd, v_bgsd, dropout_p=dropout, is_causal=True,
                                              enable_gqa=q_bnsd.shape[1] != k_bgsd.shape[1])


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
