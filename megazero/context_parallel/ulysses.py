"""All-to-all attention (``--cp-comm-type a2a``, DeepSpeed Ulysses), and the hybrid's all-to-all half.

U ranks each hold S/U tokens of all n heads. An all-to-all trades that for all S' tokens of n/U heads
(rank u gets heads u·n/U .. (u+1)·n/U - 1), attention runs on whole sequences, and an all-to-all
brings the output back to sequence shards. Heads are independent, so for pure a2a the result is the
serial SDPA's, bit for bit.

q, k and v travel in ONE all-to-all (``_pack``: each destination's heads of all three in one
buffer), and so do dq, dk and dv. Pure a2a (``inner`` None) also pipelines, unmasked over head chunks
(``_UlyssesAttention``): chunk c+1's q/k/v are in flight while chunk c's attention runs, and chunk
c's output travels back while chunk c+1's runs; the backward likewise with dout and dq/dk/dv. Under
document masks, documents lying wholly in one rank's tokens stay there and only the others travel
(``ulysses_docs``). Per rank, forward: q, k, v and out each send (U-1)/U of the local tensor;
backward: dout, dq, dk, dv.

Token order: a rank's local tokens are ``pieces`` runs of equal length (1 for the contiguous split of
pure a2a; 2 in the hybrid, piece u of ring chunk ρ then piece u of chunk 2R-1-ρ). After the
all-to-all, run p of the sequence is rank 0's run p, rank 1's run p, ... so the hybrid's rank holds
its ring position's two chunks whole, in order (``split.CPSplit``).

GQA: with g kv heads and g % U != 0, kv heads are repeated to lcm(g, U) (which divides n when n % U
== 0) so every rank receives the kv heads its query heads use; their gradients sum back.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from ..parallel import collectives
from ..parallel.collectives import Group
from .blocks import block_backward, block_forward
from .doc_blocks import Bounds, document_attention
from .logit_max import LogitMax, whole_sequence_logit_max
from .ulysses_docs import document_a2a_attention


def _seq_view(t: torch.Tensor, u: int, count: int = 1, c: int = 0) -> torch.Tensor:
    """[U dst, b, w, s, d] view of head chunk ``c`` (of ``count``) of a sequence shard [b, h, s, d]."""
    b, h, s, d = t.shape
    return t.view(b, u, count, h // (u * count), s, d)[:, :, c].transpose(0, 1)


def _head_view(y: torch.Tensor, u: int, pieces: int) -> torch.Tensor:
    """[U dst, b, w, P, s/P, d] view of a head shard [b, w, U·s, d]: the runs each rank holds."""
    b, w, su, d = y.shape
    return y.view(b, w, pieces, u, su // (u * pieces), d).permute(3, 0, 1, 2, 4, 5)


def _start(parts: list[torch.Tensor], group: Group) -> tuple[torch.Tensor, Any]:
    """Start one all-to-all of every part ([U dst, b, w, ...s..., d] views) packed in one buffer:
    (the receive buffer [U src, b, sum of w, s, d], its work)."""
    u, b, d = parts[0].shape[0], parts[0].shape[1], parts[0].shape[-1]
    s = math.prod(parts[0].shape[3:-1])
    widths = [p.shape[2] for p in parts]
    send = torch.empty(u, b, sum(widths), s, d, dtype=parts[0].dtype, device=parts[0].device)
    at = 0
    for p, w in zip(parts, widths):
        send[:, :, at:at + w].view(p.shape).copy_(p)
        at += w
    recv = torch.empty_like(send)
    return recv, collectives.all_to_all_single(recv, send, group, async_op=True)


def _slots(recv: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """Each tensor's part [U src, b, w, s, d] of a receive buffer."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return [recv[:, :, a:a + w] for a, w in zip(starts, widths)]


def _as_heads(slot: torch.Tensor, pieces: int) -> torch.Tensor:
    """[U src, b, w, s, d] -> [b, w, U·s, d] (the runs of all U ranks, run by run)."""
    u, b, w, s, d = slot.shape
    return slot.reshape(u, b, w, pieces, s // pieces, d).permute(1, 2, 3, 0, 4, 5).reshape(b, w, u * s, d)


def _exchange(tensors: list[torch.Tensor], group: Group, pieces: int, to_heads: bool) -> list[torch.Tensor]:
    """Sequence shards to head shards (or back) for several tensors in one all-to-all."""
    u = dist.get_world_size(group)
    views = [_seq_view(t, u) if to_heads else _head_view(t, u, pieces) for t in tensors]
    recv, work = _start(views, group)
    work.wait()
    slots = _slots(recv, [v.shape[2] for v in views])
    if to_heads:
        return [_as_heads(slot, pieces) for slot in slots]
    finals = [t.new_empty(t.shape[0], u * t.shape[1], t.shape[2] // u, t.shape[3]) for t in tensors]
    for final, slot in zip(finals, slots):
        _seq_view(final, u).copy_(slot)
    return finals


class _Exchange(torch.autograd.Function):
    """The all-to-all between sequence and head shards; its backward is the exchange the other way."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, pieces: int, to_heads: bool, *tensors: torch.Tensor):
        ctx.group, ctx.pieces, ctx.to_heads = group, pieces, to_heads
        return tuple(_exchange(list(tensors), group, pieces, to_heads))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        back = _exchange([g.contiguous() for g in grads], ctx.group, ctx.pieces, not ctx.to_heads)
        return (None, None, None, *back)


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


def _serial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Bounds | None) -> torch.Tensor:
    """Causal attention of whole sequences with autograd (one SDPA call per document of ``bounds``)."""
    if bounds is not None:
        return document_attention(q, k, v, bounds)
    gqa = q.shape[1] != k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def _chunk_count(heads_per_rank: int, kv_heads_per_rank: int) -> int:
    """Head chunks to pipeline: 2 when each rank's kv heads (and so its query heads) split in two."""
    return 2 if kv_heads_per_rank % 2 == 0 else 1


def _wait_into(finals: list[torch.Tensor], pending: list[tuple[torch.Tensor, Any]], u: int) -> None:
    """Wait for each chunk's all-to-all back to sequence shards and write it into ``finals``' chunk."""
    count = len(pending)
    for c, (recv, work) in enumerate(pending):
        work.wait()
        widths = [f.shape[1] // (u * count) for f in finals]
        for final, slot in zip(finals, _slots(recv, widths)):
            _seq_view(final, u, count, c).copy_(slot)


class _UlyssesAttention(torch.autograd.Function):
    """Pure a2a: q/k/v to head shards, attention, out back, pipelined over head chunks (module docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                logit_max: LogitMax | None = None) -> torch.Tensor:
        u = dist.get_world_size(group)
        count = _chunk_count(q.shape[1] // u, k.shape[1] // u)
        incoming = _start([_seq_view(t, u, count, 0) for t in (q, k, v)], group)
        saved, outgoing = [], []
        for c in range(count):
            recv, work = incoming
            work.wait()
            if c + 1 < count:  # the next chunk travels while this one is computed
                incoming = _start([_seq_view(t, u, count, c + 1) for t in (q, k, v)], group)
            qh, kh, vh = (_as_heads(slot, 1) for slot in _slots(recv, [t.shape[1] // (u * count) for t in (q, k, v)]))
            if logit_max is not None:  # this rank's heads of chunk c (``_seq_view``'s order)
                logit_max.add_blocks(qh, kh, True, dist.get_rank(group) * q.shape[1] // u + c * qh.shape[1])
            out, lse = block_forward(qh, kh, vh, True)
            saved += [qh, kh, vh, out, lse]
            outgoing.append(_start([_head_view(out, u, 1)], group))
        result = torch.empty_like(q)
        _wait_into([result], outgoing, u)
        ctx.save_for_backward(*saved)
        ctx.group, ctx.count, ctx.kv_heads = group, count, k.shape[1]
        return result

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        u, count, saved = dist.get_world_size(ctx.group), ctx.count, ctx.saved_tensors
        dout = dout.contiguous()
        incoming = _start([_seq_view(dout, u, count, 0)], ctx.group)
        outgoing = []
        for c in range(count):
            recv, work = incoming
            work.wait()
            if c + 1 < count:
                incoming = _start([_seq_view(dout, u, count, c + 1)], ctx.group)
            qh, kh, vh, out, lse = saved[5 * c:5 * c + 5]
            grads = [g.to(qh.dtype) for g in block_backward(_as_heads(recv, 1), qh, kh, vh, out, lse, True)]
            outgoing.append(_start([_head_view(g, u, 1) for g in grads], ctx.group))
        b, n, s, d = dout.shape
        finals = [dout.new_empty(b, heads, s, d) for heads in (n, ctx.kv_heads, ctx.kv_heads)]
        _wait_into(finals, outgoing, u)
        return (*finals, None, None)


def ulysses_attention(q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor, group: Group,
                      pieces: int = 1, inner=None, bounds: Bounds | None = None,
                      logit_max: LogitMax | None = None) -> torch.Tensor:
    """All-to-all to head shards, attention on whole sequences, and back.

    ``inner(q, k, v)`` given (the hybrid's ring): it runs between two autograd exchanges. Otherwise
    causal attention (one call per document of ``bounds``) runs inside the pipelined exchange.
    ``logit_max`` (QK-clip): the per-head maximum logit, each rank's at its head shard's offset."""
    u = 1 if group is None else dist.get_world_size(group)
    if u > 1:
        check_heads(q_bnsd.shape[1], k_bgsd.shape[1], u)
        k_bgsd, v_bgsd = replicate_kv_heads(k_bgsd, u), replicate_kv_heads(v_bgsd, u)
    if inner is None and u > 1 and bounds is not None:
        return document_a2a_attention(q_bnsd, k_bgsd, v_bgsd, group, bounds, logit_max)
    if inner is None and u > 1:
        return _UlyssesAttention.apply(q_bnsd.contiguous(), k_bgsd.contiguous(), v_bgsd.contiguous(), group,
                                       logit_max)
    if inner is None:
        if logit_max is not None:
            whole_sequence_logit_max(logit_max, q_bnsd, k_bgsd, bounds)
        inner = functools.partial(_serial_attention, bounds=bounds)
        logit_max = None
    if logit_max is not None:  # the inner ring's heads: this rank's head shard
        heads = q_bnsd.shape[1] // u
        inner = functools.partial(inner, logit_max=logit_max.at(0 if u == 1 else dist.get_rank(group) * heads,
                                                                heads))
    if u == 1:
        return inner(q_bnsd, k_bgsd, v_bgsd)
    q, k, v = _Exchange.apply(group, pieces, True, q_bnsd.contiguous(), k_bgsd.contiguous(), v_bgsd.contiguous())
    return _Exchange.apply(group, pieces, False, inner(q, k, v).contiguous())[0]
