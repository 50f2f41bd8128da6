"""All-to-all attention (``--cp-comm-type a2a``, DeepSpeed Ulysses), and the hybrid's all-to-all half.

U ranks each hold S/U tokens of all n heads. One all-to-all per tensor trades that for all S' tokens
of n/U heads (rank u gets heads u·n/U .. (u+1)·n/U - 1), attention runs on whole sequences, and one
all-to-all brings the output back to sequence shards. Heads are independent, so for pure a2a the
result is the serial SDPA's, bit for bit. Backward: the same all-to-alls the other way (four forward:
q, k, v, out; four backward: dout, dq, dk, dv; each sends (U-1)/U of the local tensor).

Token order: a rank's local tokens are ``pieces`` runs of equal length (1 for the contiguous split of
pure a2a; 2 in the hybrid, piece u of ring chunk ρ then piece u of chunk 2R-1-ρ). After the
all-to-all, run p of the sequence is rank 0's run p, rank 1's run p, ... so the hybrid's rank holds
its ring position's two chunks whole, in order (``split.CPSplit``).

GQA: with g kv heads and g % U != 0, kv heads are repeated to lcm(g, U) (which divides n when n % U
== 0) so every rank receives the kv heads its query heads use; their gradients sum back.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel import collectives
from ..parallel.collectives import Group


def _a2a(send: torch.Tensor, group: Group) -> torch.Tensor:
    recv = torch.empty_like(send)
    collectives.all_to_all_single(recv, send, group)
    return recv


def _seq_to_head(x_bhsd: torch.Tensor, group: Group, pieces: int) -> torch.Tensor:
    """[b, h, s, d] (s = pieces runs) -> [b, h/U, U·s, d] (the runs of all U ranks, run by run)."""
    u = dist.get_world_size(group)
    b, h, s, d = x_bhsd.shape
    send = x_bhsd.reshape(b, u, h // u, s, d).transpose(0, 1).contiguous()  # [U dst, b, h/U, s, d]
    recv = _a2a(send, group).view(u, b, h // u, pieces, s // pieces, d)  # [U src, b, h/U, P, s/P, d]
    return recv.permute(1, 2, 3, 0, 4, 5).reshape(b, h // u, u * s, d)


def _head_to_seq(y_bhsd: torch.Tensor, group: Group, pieces: int) -> torch.Tensor:
    """The inverse of ``_seq_to_head``: [b, h/U, U·s, d] -> [b, h, s, d]."""
    u = dist.get_world_size(group)
    b, hu, su, d = y_bhsd.shape
    s = su // u
    send = y_bhsd.reshape(b, hu, pieces, u, s // pieces, d).permute(3, 0, 1, 2, 4, 5).contiguous()
    recv = _a2a(send, group)  # [U src (its heads), b, h/U, P, s/P, d]
    return recv.permute(1, 0, 2, 3, 4, 5).reshape(b, u * hu, s, d)


class _Exchange(torch.autograd.Function):
    """The all-to-all between sequence and head shards; its backward is the exchange the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, pieces: int, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.pieces, ctx.to_heads = group, pieces, to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, group, pieces)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _head_to_seq if ctx.to_heads else _seq_to_head
        return back(grad.contiguous(), ctx.group, ctx.pieces), None, None, None


def check_heads(heads: int, kv_heads: int, a2a_size: int) -> None:
    """One line naming the flags when the heads on a rank cannot be dealt out over ``a2a_size`` ranks."""
    if heads % a2a_size:
        raise ValueError(f"all-to-all context parallelism needs the attention heads per TP rank ({heads}) to be "
                         f"divisible by the all-to-all size ({a2a_size}: --cp for --cp-comm-type a2a, "
                         "--cp-a2a-size for a2a+p2p); change --num-attention-heads, --tp or --cp.")
    if heads % kv_heads:
        raise ValueError(f"--num-attention-heads per TP rank ({heads}) must be a multiple of the kv heads "
                         f"({kv_heads}, --num-query-groups per TP rank).")


def replicate_kv_heads(t_bgsd: torch.Tensor, a2a_size: int) -> torch.Tensor:
    """kv heads repeated to lcm(g, U), so each of U ranks gets whole kv heads for its query heads."""
    g = t_bgsd.shape[1]
    if g % a2a_size == 0:
        return t_bgsd
    return t_bgsd.repeat_interleave(math.lcm(g, a2a_size) // g, dim=1)


def ulysses_attention(q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor, group: Group,
                      pieces: int = 1, inner=None) -> torch.Tensor:
    """All-to-all to head shards, ``inner(q, k, v)`` on whole sequences (default causal SDPA), and back."""
    if inner is None:
        def inner(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    if group is None or dist.get_world_size(group) == 1:
        return inner(q_bnsd, k_bgsd, v_bgsd)
    u = dist.get_world_size(group)
    check_heads(q_bnsd.shape[1], k_bgsd.shape[1], u)
    k_bgsd, v_bgsd = replicate_kv_heads(k_bgsd, u), replicate_kv_heads(v_bgsd, u)
    q, k, v = (_Exchange.apply(t, group, pieces, True) for t in (q_bnsd, k_bgsd, v_bgsd))
    return _Exchange.apply(inner(q, k, v), group, pieces, False)
