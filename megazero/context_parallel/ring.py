"""Ring attention (``--cp-comm-type p2p``): K/V travel around the CP ring, queries stay.

Each of R ring ranks holds L = S/R tokens in the load-balanced order of ``split.CPSplit``: chunk ρ
(early) then chunk 2R-1-ρ (late), each L/2 tokens. At step i a rank holds the K/V of ring rank
j = ρ - i (mod R); the block it computes follows from where those chunks lie:

    i = 0     own K/V: causal over the local order (it is increasing in global position)
    j < ρ     all L queries vs the FIRST half of K/V (chunk j precedes both of ours; chunk 2R-1-j
              follows both), no mask
    j > ρ     the SECOND half of the queries (chunk 2R-1-ρ) vs all of K/V, no mask

so every step past the first computes L²/2 scores and no rank computes a masked one: the work is the
same on every rank (``attention_work``). With ``balanced=False`` (a contiguous split, for comparison
only) j < ρ is a full block and j > ρ nothing, so the last rank does the most.

The next K/V is sent (isend/irecv through ``collectives.batch_isend_irecv``) before the current block
is computed, so the exchange overlaps attention. GQA: only the g kv heads travel. Partial outputs merge
with their LSE in fp32 (``blocks.merge``). Backward: K/V rotate again; a dK/dV accumulator for the K/V
in hand travels with it, each rank adding its share, and after R hops it is back with its owner.
Per rank and call: forward (R-1) sends of [K; V]; backward (R-1) of [K; V] and R of [dK; dV] (in the
accumulation dtype: fp32, or fp64 for fp64 inputs).

Documents (``bounds``): each step computes only the per-document pieces of the local runs against the
held K/V's runs (``doc_blocks.document_blocks``); a block no document spans is skipped (the K/V still
pass on, since later ranks need them), and rows a block does not reach merge in at lse = -inf.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import collectives
from ..parallel.collectives import Group
from .blocks import acc_dtype, block_backward, block_forward, merge
from .doc_blocks import Bounds, Piece, document_attention, document_blocks, ring_runs

_KV_TAG, _DKV_TAG = 11, 12  # two exchanges can be in flight between the same pair of ranks

Block = tuple[slice, slice, bool]  # (query rows, key rows, causal)


def ring_blocks(step: int, rank: int, size: int, local_len: int, balanced: bool = True) -> list[Block]:
    """The blocks ring rank ``rank`` computes at ``step`` (holding the K/V of rank ``rank - step``)."""
    everything = slice(0, local_len)
    if step == 0:
        return [(everything, everything, True)]
    src = (rank - step) % size
    if not balanced:
        return [(everything, everything, False)] if src < rank else []
    half = local_len // 2
    if src < rank:
        return [(everything, slice(0, half), False)]
    return [(slice(half, local_len), everything, False)]


def attention_work(rank: int, size: int, local_len: int, balanced: bool = True) -> int:
    """Unmasked query-key scores ring rank ``rank`` computes in one forward (equal over ranks if balanced)."""
    total = 0
    for step in range(size):
        for qs, ks, causal in ring_blocks(step, rank, size, local_len, balanced):
            nq, nk = qs.stop - qs.start, ks.stop - ks.start
            total += nq * (nq + 1) // 2 if causal else nq * nk
    return total


class _Ring:
    """This rank's place in the ring and the exchange of one tensor with its neighbours."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending ``t`` to the next rank and receiving the previous rank's; (its buffer, handles)."""
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag),
               dist.P2POp(dist.irecv, buf, self.prev, self.group, tag)]
        return buf, collectives.batch_isend_irecv(ops, self.group)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _rows(t: torch.Tensor, b: slice, s: slice) -> torch.Tensor:
    return t[b, :, s]


_ALL = slice(None)


def step_pieces(step: int, ring: "_Ring", local_len: int, balanced: bool,
                bounds: Bounds | None) -> list[Piece]:
    """What this rank computes at ``step``: the causal ring's blocks for every sample, or, with documents,
    the per-document pieces of its runs against the held K/V's runs (none: the block is skipped)."""
    if bounds is None:
        return [(_ALL, qs, ks, causal) for qs, ks, causal in ring_blocks(step, ring.rank, ring.size, local_len,
                                                                         balanced)]
    src = (ring.rank - step) % ring.size
    return document_blocks(ring_runs(ring.rank, ring.size, local_len), ring_runs(src, ring.size, local_len), bounds)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring, balanced: bool,
             force_math: bool, bounds: Bounds | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in the accumulation dtype, lse [b, n, L]) of the local queries against every rank's K/V."""
    local_len = q.shape[2]
    kv = torch.stack([k, v])  # [2, b, g, L, d]: one message per step
    out = lse = None
    if bounds is not None:  # pieces cover the rows piecemeal: start from "no key seen" (out 0, lse -inf)
        out = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for step in range(ring.size):
        nxt, works = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else (None, [])
        for bs, qs, ks, causal in step_pieces(step, ring, local_len, balanced, bounds):
            out_b, lse_b = block_forward(_rows(q, bs, qs), _rows(kv[0], bs, ks), _rows(kv[1], bs, ks), causal,
                                         force_math)
            if out is None:  # step 0 covers every row
                out, lse = out_b.to(acc_dtype(q.dtype)), lse_b
            else:
                out[bs, :, qs], lse[bs, :, qs] = merge(_rows(out, bs, qs), _rows(lse, bs, qs), out_b, lse_b)
        _wait(works)  # blocked time here is K/V the ring did not hide
        kv = nxt
    return out, lse


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, ring: _Ring, balanced: bool, force_math: bool,
              bounds: Bounds | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the accumulation dtype; dk/dv are this rank's own K/V's, summed over the ring."""
    acc, local_len = acc_dtype(q.dtype), q.shape[2]
    kv = torch.stack([k, v])
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv_in, dkv_works, dkv_sent = None, [], None
    for step in range(ring.size):
        nxt, kv_works = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else (None, [])
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for bs, qs, ks, causal in step_pieces(step, ring, local_len, balanced, bounds):
            dq_b, dk_b, dv_b = block_backward(_rows(dout, bs, qs), _rows(q, bs, qs), _rows(kv[0], bs, ks),
                                              _rows(kv[1], bs, ks), _rows(out, bs, qs), _rows(lse, bs, qs), causal,
                                              force_math)
            dq[bs, :, qs] += dq_b
            dkv[0][bs, :, ks] += dk_b
            dkv[1][bs, :, ks] += dv_b
        if step > 0:
            _wait(dkv_works)  # the accumulator for this K/V, with the earlier ranks' shares
            dkv += dkv_in
        dkv_sent = dkv  # kept alive until its send is waited on
        dkv_in, dkv_works = ring.shift(dkv_sent, _DKV_TAG)
        _wait(kv_works)
        kv = nxt
    _wait(dkv_works)  # after R hops: our own K/V's accumulator, every rank's share in it
    del dkv_sent
    return dq, dkv_in[0], dkv_in[1]


class _RingAttention(torch.autograd.Function):
    """forward: causal attention of the local queries over the ring's K/V / backward: the same ring, dK/dV home."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                balanced: bool, force_math: bool, bounds: Bounds | None) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ring = _Ring(group)
        out, lse = _forward(q, k, v, ring, balanced, force_math, bounds)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.balanced, ctx.force_math, ctx.bounds = ring, balanced, force_math, bounds
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, ctx.ring, ctx.balanced, ctx.force_math,
                               ctx.bounds)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor, group: Group,
                   balanced: bool = True, force_math: bool = False, bounds: Bounds | None = None) -> torch.Tensor:
    """Causal attention of this ring rank's tokens (``CPSplit`` local order) over the whole sequence.

    ``balanced=False``: the tokens are a contiguous split (a baseline, not used for training).
    ``force_math``: the matmul kernels even where torch's CPU flash op would serve (for tests).
    ``bounds``: per-sample document starts (``doc_blocks``): attention stays inside each document.
    """
    if q_bnsd.shape[1] % k_bgsd.shape[1]:
        raise ValueError(f"query heads ({q_bnsd.shape[1]}) must be a multiple of kv heads ({k_bgsd.shape[1]}); "
                         "check --num-attention-heads / --num-query-groups")
    if group is None or dist.get_world_size(group) == 1:  # a ring of one: the serial attention
        if bounds is not None:
            return document_attention(q_bnsd, k_bgsd, v_bgsd, bounds)
        return torch.nn.functional.scaled_dot_product_attention(
            q_bnsd, k_bgsd, v_bgsd, is_causal=True, enable_gqa=q_bnsd.shape[1] != k_bgsd.shape[1])
    if balanced and q_bnsd.shape[2] % 2:
        raise ValueError(f"the load-balanced split needs an even number of local tokens, got {q_bnsd.shape[2]}")
    assert bounds is None or balanced, "document pieces follow the load-balanced split"
    return _RingAttention.apply(q_bnsd, k_bgsd, v_bgsd, group, balanced, force_math, bounds)
