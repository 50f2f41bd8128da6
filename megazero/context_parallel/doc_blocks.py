"""Attention over packed documents: only the (query, key) pairs inside one document are computed.

``bounds`` (``model.documents.Bounds``) holds, per sample, the start of every document and the
sample length S. The mask is block-diagonal causal: query i sees key j iff both lie in the same
document and j <= i.

Whole sequences (no CP, or Ulysses after its all-to-all): ``document_attention`` calls the fused
causal kernel (``blocks.block_forward``) once per document on that document's slice, writing into one
output, so nothing outside the diagonal blocks is computed and no S x S mask is built.

Under the ring, a rank holds its tokens as *runs*: contiguous global ranges at known local offsets
(two chunks, ρ and 2R-1-ρ, of the load-balanced split). ``document_blocks`` intersects a query run
and a key run with every document; each non-empty piece is either dense (the document's keys all
precede its queries) or the causal square (the same run), so the fused block kernel handles it
without a mask, and a K/V block that meets no query's document yields no piece at all: skipped.
"""
from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from .blocks import acc_dtype, block_backward, block_forward

Bounds = tuple[tuple[int, ...], ...]  # per sample: 0, each later document's start, S (cu_seqlens)
Run = tuple[int, int, int]  # (local start, global start, length)
Piece = tuple[slice, slice, slice, bool]  # (sample, query rows, key rows, causal), local indices


def causal_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   bounds: Bounds | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of causal attention over whole sequences: one fused call, or one per document."""
    if bounds is None:
        return block_forward(q, k, v, True)
    assert len(bounds) == q.shape[0] and bounds[0][-1] == q.shape[2], "bounds do not match the batch"
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=acc_dtype(q.dtype), device=q.device)
    for rows in document_rows(bounds):
        out[rows], lse[rows] = block_forward(q[rows], k[rows], v[rows], True)
    return out, lse


def causal_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, bounds: Bounds | None) -> list[torch.Tensor]:
    """(dq, dk, dv) in q's dtype of ``causal_forward``, each document's written in place."""
    if bounds is None:
        return [g.to(q.dtype) for g in block_backward(dout, q, k, v, out, lse, True)]
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for rows in document_rows(bounds):
        for grad, part in zip(grads, block_backward(dout[rows], q[rows], k[rows], v[rows], out[rows], lse[rows],
                                                    True)):
            grad[rows] = part
    return grads


def document_rows(bounds: Bounds) -> list[tuple[slice, slice, slice]]:
    return [(slice(b, b + 1), slice(None), slice(s, e))
            for b, cuts in enumerate(bounds) for s, e in zip(cuts[:-1], cuts[1:])]


class _DocumentAttention(torch.autograd.Function):
    """Per-document causal attention writing into one output (and one gradient per input): slicing under
    autograd would add a whole-size gradient per document."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Bounds) -> torch.Tensor:
        out, lse = causal_forward(q, k, v, bounds)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bounds = bounds
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        return (*causal_backward(dout.contiguous(), q, k, v, out, lse, ctx.bounds), None)


def document_attention(q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor,
                       bounds: Bounds, dropout_p: float = 0.0) -> torch.Tensor:
    """Block-diagonal causal attention of whole sequences: one fused causal call per document (with
    attention dropout: one SDPA call per document, whose kernel draws the dropout)."""
    assert len(bounds) == q_bnsd.shape[0] and bounds[0][-1] == q_bnsd.shape[2], "bounds do not match the batch"
    if dropout_p == 0.0:
        return _DocumentAttention.apply(q_bnsd, k_bgsd, v_bgsd, bounds)
    gqa = q_bnsd.shape[1] != k_bgsd.shape[1]
    samples = []
    for b, cuts in enumerate(bounds):
        docs = [F.scaled_dot_product_attention(q_bnsd[b:b + 1, :, s:e], k_bgsd[b:b + 1, :, s:e],
                                               v_bgsd[b:b + 1, :, s:e], dropout_p=dropout_p, is_causal=True,
                                               enable_gqa=gqa)
                for s, e in zip(cuts[:-1], cuts[1:])]
        samples.append(torch.cat(docs, dim=2))
    return torch.cat(samples, dim=0)


def ring_runs(ring_rank: int, ring_size: int, local_len: int) -> list[Run]:
    """The two chunks ring rank ``ring_rank`` holds in the load-balanced split (``split.CPSplit``)."""
    chunk = local_len // 2
    return [(0, ring_rank * chunk, chunk), (chunk, (2 * ring_size - 1 - ring_rank) * chunk, chunk)]


def _pair_pieces(q_run: Run, k_run: Run, cuts: tuple[int, ...]) -> list[tuple[slice, slice, bool]]:
    """Pieces of one query run against one key run, one per document that holds both queries and keys."""
    (ql, qg, qn), (kl, kg, kn) = q_run, k_run
    if kg >= qg + qn:  # every key follows every query
        return []
    same = (qg, qn) == (kg, kn)
    assert same or kg + kn <= qg, "runs must be the same range or disjoint"
    pieces = []
    d = bisect.bisect_right(cuts, qg) - 1  # the document holding the first query
    while d < len(cuts) - 1 and cuts[d] < qg + qn:
        qa, qb = max(qg, cuts[d]), min(qg + qn, cuts[d + 1])
        ka, kb = max(kg, cuts[d]), min(kg + kn, cuts[d + 1])
        if ka < kb:
            pieces.append((slice(ql + qa - qg, ql + qb - qg), slice(kl + ka - kg, kl + kb - kg), same))
        d += 1
    return pieces


def document_blocks(q_runs: list[Run], k_runs: list[Run], bounds: Bounds) -> list[Piece]:
    """Every non-empty (sample, query rows, key rows, causal) piece of local queries against a K/V block."""
    pieces = []
    for b, cuts in enumerate(bounds):
        for q_run in q_runs:
            for k_run in k_runs:
                pieces += [(slice(b, b + 1), qs, ks, causal) for qs, ks, causal in _pair_pieces(q_run, k_run, cuts)]
    return pieces


def pairs(pieces: list[Piece]) -> int:
    """Query-key pairs the pieces compute (a causal square of n rows: n(n+1)/2)."""
    total = 0
    for _, qs, ks, causal in pieces:
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        total += nq * (nq + 1) // 2 if causal else nq * nk
    return total

