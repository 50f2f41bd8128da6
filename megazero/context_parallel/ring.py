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
with their LSE in fp32 (``blocks.merge``). Backward: K/V rotate again; the dK/dV of a rank's own block
stay home, and an accumulator for another rank's K/V starts on the rank after it, travels with it,
each rank adding its share, and after R-1 hops is back with its owner. Per rank and call, at most:
forward (R-1) sends of [K; V]; backward (R-1) of [K; V] and (R-1) of [dK; dV] (in the accumulation
dtype: fp32, or fp64 for fp64 inputs).

Documents (``bounds``): each step computes only the per-document pieces of the local runs against the
held K/V's runs (``doc_blocks.document_blocks``), and rows a block does not reach merge in at lse =
-inf.

What travels: a hop carries only the rows of the K/V that some rank still ahead uses (``needed_rows``:
per chunk of the owner, the span from the first to the last such row), nothing when none does; the
dK/dV accumulator carries the rows any rank uses. Every rank derives the same spans. Unmasked, that
is every row but for rank 0's K/V, whose late chunk no other rank's query sees (half its rows travel);
with documents, only the rows of documents that cross chunks.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..parallel import collectives
from ..parallel.collectives import Group
from .blocks import acc_dtype, block_backward, block_forward, merge
from .doc_blocks import Bounds, Piece, document_attention, document_blocks, ring_runs
from .logit_max import LogitMax, whole_sequence_logit_max

_KV_TAG, _DKV_TAG = 11, 12  # two exchanges can be in flight between the same pair of ranks

Block = tuple[slice, slice, bool]  # (query rows, key rows, causal)
Span = tuple[int, int]  # [lo, hi) of local rows
_ALL = slice(None)


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


@functools.lru_cache(maxsize=256)
def pieces_of(rank: int, src: int, size: int, local_len: int, balanced: bool,
              bounds: Bounds | None) -> tuple[Piece, ...]:
    """What ring rank ``rank`` computes against ring rank ``src``'s K/V: the causal ring's blocks for every
    sample, or, with documents, the per-document pieces of its runs against src's runs (none: skipped);
    causal pieces first. Cached: a run asks for the same few every layer and step."""
    if bounds is None:
        return tuple((_ALL, qs, ks, causal) for qs, ks, causal in ring_blocks((rank - src) % size, rank, size,
                                                                              local_len, balanced))
    pieces = document_blocks(ring_runs(rank, size, local_len), ring_runs(src, size, local_len), bounds)
    return tuple(sorted(pieces, key=lambda piece: not piece[3]))


@functools.lru_cache(maxsize=256)
def needed_rows(src: int, receivers: tuple[int, ...], size: int, local_len: int, balanced: bool,
                bounds: Bounds | None) -> tuple[Span, Span]:
    """Per half of ring rank ``src``'s local rows (its two chunks): the span [lo, hi) of the key rows the
    pieces of any of ``receivers`` use, in any sample (empty: lo = hi)."""
    half = local_len // 2
    runs = ((0, half), (half, local_len))
    lo, hi = [local_len, local_len], [0, 0]
    for r in receivers:
        for _, _, ks, _ in pieces_of(r, src, size, local_len, balanced, bounds):
            for i, (a, b) in enumerate(runs):
                if max(ks.start, a) < min(ks.stop, b):
                    lo[i], hi[i] = min(lo[i], max(ks.start, a)), max(hi[i], min(ks.stop, b))
    spans = [(lo[i], hi[i]) if lo[i] < hi[i] else (runs[i][0], runs[i][0]) for i in range(2)]
    return spans[0], spans[1]


class _Rows:
    """A K/V block's rows as sent: spans of the owner's local rows (one per run), laid end to end."""

    def __init__(self, spans: tuple[Span, Span]) -> None:
        self.spans = spans
        self.offsets = (0, spans[0][1] - spans[0][0])
        self.count = self.offsets[1] + spans[1][1] - spans[1][0]

    def slot(self, rows: slice) -> slice:
        """Where the owner's local ``rows`` (inside one span; any rows when the spans are everything) lie."""
        run = 0 if rows.start < self.spans[0][1] or self.spans[1][0] == self.spans[1][1] else 1
        shift = self.offsets[run] - self.spans[run][0]
        return slice(rows.start + shift, rows.stop + shift)

    def gather(self, t: torch.Tensor, held: "_Rows") -> torch.Tensor:
        """This layout's rows (dim -2) out of ``t``, laid out as ``held`` (which covers them)."""
        if self.spans == held.spans:
            return t
        parts = [t[..., held.slot(slice(lo, hi)), :] for lo, hi in self.spans if lo < hi]
        return torch.cat(parts, dim=-2)

    def add_into(self, full: torch.Tensor, t: torch.Tensor) -> None:
        """``full`` (all local rows, dim -2) += ``t`` (laid out as self)."""
        for lo, hi in self.spans:
            if lo < hi:
                full[..., lo:hi, :] += t[..., self.slot(slice(lo, hi)), :]


class _Ring:
    """This rank's place in the ring, the exchanges with its neighbours, and what each hop carries."""

    def __init__(self, group: dist.ProcessGroup, local_len: int, balanced: bool, bounds: Bounds | None) -> None:
        self.group, self.local_len, self.balanced, self.bounds = group, local_len, balanced, bounds
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def pieces(self, step: int) -> tuple[Piece, ...]:
        """What this rank computes at ``step``, holding the K/V of ring rank ``rank - step``. At step 0 the
        causal pieces come first and tile every local query row and every own key row exactly once (each
        row's document inside its own run), so they write their rows and every later piece adds."""
        return pieces_of(self.rank, (self.rank - step) % self.size, self.size, self.local_len, self.balanced,
                         self.bounds)

    def hop_rows(self, src: int, hop: int) -> _Rows:
        """The rows of ring rank ``src``'s K/V on its ``hop``-th hop: those some rank still ahead uses."""
        src %= self.size
        ahead = tuple((src + h) % self.size for h in range(hop, self.size))
        return _Rows(needed_rows(src, ahead, self.size, self.local_len, self.balanced, self.bounds))

    def exchange(self, send: torch.Tensor | None, buf: torch.Tensor | None, tag: int) -> tuple:
        """Send ``send`` to the next rank and receive into ``buf`` from the previous one (either may be
        None: nothing of it travels); (``buf``, handles)."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag)] if send is not None else []
        if buf is not None:
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.group, tag))
        return buf, (collectives.batch_isend_irecv(ops, self.group) if ops else [])

    def shift_kv(self, kv: torch.Tensor | None, held: _Rows, step: int, whole: torch.Tensor) -> tuple:
        """Pass on the K/V held at ``step`` (rows ``held``; None: no rows) for ``step`` + 1; (buffer, its
        rows, handles). ``whole``: this rank's own [K; V], whose shape the buffers take but for rows."""
        src, nxt_src = self.rank - step, self.rank - step - 1
        out_rows, in_rows = self.hop_rows(src, step + 1), self.hop_rows(nxt_src, step + 1)
        send = out_rows.gather(kv, held).contiguous() if out_rows.count and kv is not None else None
        buf, works = self.exchange(send, _rows_buffer(whole, in_rows.count, whole.dtype), _KV_TAG)
        return buf, in_rows, works


def _rows_buffer(like: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A receive buffer shaped as ``like`` but with ``rows`` rows (dim -2); None for no rows (nothing travels)."""
    return like.new_empty(*like.shape[:-2], rows, like.shape[-1], dtype=dtype) if rows else None


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _rows(t: torch.Tensor, b: slice, s: slice) -> torch.Tensor:
    return t[b, :, s]


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring, force_math: bool,
             logit_max: LogitMax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in the accumulation dtype, lse [b, n, L]) of the local queries against every rank's K/V;
    ``logit_max`` (QK-clip): the maximum logit of every piece computed, per head."""
    whole = torch.stack([k, v])  # [2, b, g, L, d]: one message per step
    kv, held = whole, ring.hop_rows(ring.rank, 0)
    out = torch.empty(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
    lse = torch.empty(q.shape[:3], dtype=acc_dtype(q.dtype), device=q.device)
    for step in range(ring.size):
        nxt, nxt_rows, works = ring.shift_kv(kv, held, step, whole) if step < ring.size - 1 else (None, None, [])
        for bs, qs, ks, causal in ring.pieces(step):
            ks = held.slot(ks)
            if logit_max is not None:
                logit_max.add_blocks(_rows(q, bs, qs), _rows(kv[0], bs, ks), causal)
            out_b, lse_b = block_forward(_rows(q, bs, qs), _rows(kv[0], bs, ks), _rows(kv[1], bs, ks), causal,
                                         force_math)
            if step == 0 and causal:  # the first write of these rows (see ``_Ring.pieces``)
                out[bs, :, qs], lse[bs, :, qs] = out_b, lse_b
            else:
                out[bs, :, qs], lse[bs, :, qs] = merge(_rows(out, bs, qs), _rows(lse, bs, qs), out_b, lse_b)
        _wait(works)  # blocked time here is K/V the ring did not hide
        kv, held = nxt, nxt_rows
    return out, lse


def _block_grads(dout, q, kv, out, lse, ring: _Ring, step: int, held: _Rows, dq: torch.Tensor,
                 dkv: torch.Tensor, dkv_rows: _Rows, force_math: bool) -> None:
    """Add this step's pieces' gradients into dq and dkv (laid out as ``dkv_rows``)."""
    for bs, qs, ks, causal in ring.pieces(step):
        kslice = held.slot(ks)
        dq_b, dk_b, dv_b = block_backward(_rows(dout, bs, qs), _rows(q, bs, qs), _rows(kv[0], bs, kslice),
                                          _rows(kv[1], bs, kslice), _rows(out, bs, qs), _rows(lse, bs, qs), causal,
                                          force_math)
        home = dkv_rows.slot(ks)
        if step == 0 and causal:  # the first write of these query and key rows (see ``_Ring.pieces``)
            dq[bs, :, qs], dkv[0][bs, :, home], dkv[1][bs, :, home] = dq_b, dk_b, dv_b
        else:
            dq[bs, :, qs] += dq_b
            dkv[0][bs, :, home] += dk_b
            dkv[1][bs, :, home] += dv_b


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, ring: _Ring,
              force_math: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the accumulation dtype; dk/dv are this rank's own K/V's, summed over the ring.

    The own block's dK/dV stay home; the accumulator for another rank's K/V starts on the first rank
    after it, travels with the K/V (rows: those any rank uses), each adds its share, and goes home."""
    acc = acc_dtype(q.dtype)
    whole = torch.stack([k, v])
    kv, held = whole, ring.hop_rows(ring.rank, 0)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    own = torch.empty(whole.shape, dtype=acc, device=q.device)
    acc_in: torch.Tensor | None = None
    acc_works: list = []
    sent: list[torch.Tensor] = []
    for step in range(ring.size):
        nxt, nxt_rows, kv_works = ring.shift_kv(kv, held, step, whole) if step < ring.size - 1 else (None, None, [])
        src = ring.rank - step
        rows = held if step == 0 else ring.hop_rows(src, 1)
        dkv = own if step == 0 else own.new_zeros(*own.shape[:-2], rows.count, own.shape[-1])
        _block_grads(dout, q, kv, out, lse, ring, step, held, dq, dkv, rows, force_math)
        if step > 0:
            _wait(acc_works)  # the accumulator for this K/V, with the earlier ranks' shares
            if acc_in is not None:
                dkv += acc_in
            in_rows = ring.hop_rows(src - 1, 1)
            acc_in, acc_works = ring.exchange(dkv if rows.count else None, _rows_buffer(whole, in_rows.count, acc),
                                              _DKV_TAG)
            sent.append(dkv)  # kept alive until its send is waited on
        _wait(kv_works)
        kv, held = nxt, nxt_rows
    _wait(acc_works)  # after R - 1 hops: every other rank's share of our own K/V's gradient
    if acc_in is not None:
        ring.hop_rows(ring.rank, 1).add_into(own, acc_in)
    del sent
    return dq, own[0], own[1]


class _RingAttention(torch.autograd.Function):
    """forward: causal attention of the local queries over the ring's K/V / backward: the same ring, dK/dV home."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                balanced: bool, force_math: bool, bounds: Bounds | None,
                logit_max: LogitMax | None = None) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ring = _Ring(group, q.shape[2], balanced, bounds)
        out, lse = _forward(q, k, v, ring, force_math, logit_max)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.force_math = ring, force_math
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, ctx.ring, ctx.force_math)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor, group: Group,
                   balanced: bool = True, force_math: bool = False, bounds: Bounds | None = None,
                   logit_max: LogitMax | None = None) -> torch.Tensor:
    """Causal attention of this ring rank's tokens (``CPSplit`` local order) over the whole sequence.

    ``balanced=False``: the tokens are a contiguous split (a baseline, not used for training).
    ``force_math``: the matmul kernels even where torch's CPU flash op would serve (for tests).
    ``bounds``: per-sample document starts (``doc_blocks``): attention stays inside each document.
    ``logit_max`` (QK-clip): the per-head maximum logit over the pieces computed (``logit_max.LogitMax``).
    """
    if q_bnsd.shape[1] % k_bgsd.shape[1]:
        raise ValueError(f"query heads ({q_bnsd.shape[1]}) must be a multiple of kv heads ({k_bgsd.shape[1]}); "
                         "check --num-attention-heads / --num-query-groups")
    if group is None or dist.get_world_size(group) == 1:  # a ring of one: the serial attention
        if logit_max is not None:
            whole_sequence_logit_max(logit_max, q_bnsd, k_bgsd, bounds)
        if bounds is not None:
            return document_attention(q_bnsd, k_bgsd, v_bgsd, bounds)
        return torch.nn.functional.scaled_dot_product_attention(
            q_bnsd, k_bgsd, v_bgsd, is_causal=True, enable_gqa=q_bnsd.shape[1] != k_bgsd.shape[1])
    if balanced and q_bnsd.shape[2] % 2:
        raise ValueError(f"the load-balanced split needs an even number of local tokens, got {q_bnsd.shape[2]}")
    assert bounds is None or balanced, "document pieces follow the load-balanced split"
    return _RingAttention.apply(q_bnsd, k_bgsd, v_bgsd, group, balanced, force_math, bounds, logit_max)
