"""DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``, DeepSpeed 0.19.8) on CPU/gloo.

The peer of megazero's context-parallel attention core (``bench.bench_cp_peer``): DeepSpeed's
all-to-all wrapper around the same local attention megazero runs on whole sequences, causal SDPA,
or one causal SDPA per document (``doc_blocks.document_attention``) under document masks. Its
tensors are [b, s, heads, d] (batch first: ``batch_dim_idx=0``, heads scattered, sequence gathered),
the layout DistributedAttention is written for; the local attention views them as [b, heads, s, d].
Needs ``DS_ACCELERATOR=cpu`` (set here before DeepSpeed is imported) and a gloo world already up.
"""
from __future__ import annotations

import os
from typing import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megazero.context_parallel.doc_blocks import Bounds, document_attention  # noqa: E402

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _LocalAttention(torch.nn.Module):
    """Causal attention of whole sequences in DeepSpeed's layout ([b, s, h, d] in and out)."""

    def __init__(self, bounds: Bounds | None) -> None:
        super().__init__()
        self.bounds = bounds

    def forward(self, q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_bshd, k_bshd, v_bshd))
        if self.bounds is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        else:
            out = document_attention(q, k, v, self.bounds)
        return out.transpose(1, 2)


def ulysses_attention(group, bounds: Bounds | None = None) -> Attention:
    """``f(q, k, v)`` on this rank's contiguous S/cp tokens, [b, s, h, d]: DeepSpeed's all-to-all attention."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # adopts the world already up
    layer = DistributedAttention(_LocalAttention(bounds), group, scatter_idx=2, gather_idx=1)
    return lambda q, k, v: layer(q, k, v, batch_dim_idx=0)
