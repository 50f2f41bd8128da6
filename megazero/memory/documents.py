"""What the planner assumes about packed documents under ``--reset-attention-mask``.

The lengths of the packed documents are known only once data is read, so a plan assumes every
sample cut into documents of ``--plan-document-length`` L tokens (the last one shorter when L does
not divide S); without it, L = S: one document per sample, the upper bound of every figure below
(plain causal attention's). From that sample:

    attention work   the attention core's FLOPs scale by the attended share, sum_d L_d (L_d + 1) / 2 over
                     S (S + 1) / 2 (``model.documents.attended_share``, the trainer's formula); under the
                     ring each rank computes its own queries' pairs, and the slowest rank sets the step
    math kernel      one call per document keeps its softmax, mask and dropped scores: 3 b n sum_d L_d^2 e / t
                     instead of 3 b n S^2 e / t (measured: ``tests/memory/test_document_plan.py``)
    flash kernel     the per-document calls write into one output: the bytes of causal attention
                     (measured, same test)
    context parallel the ring's core keeps the same bytes; the all-to-all's keeps its heads' q, k, v,
                     output and lse of the tokens whose documents travel besides (``a2a_shared_tokens``;
                     measured, same test); a ring hop carries only the K/V rows some rank ahead uses
                     (``ring_hop_shares``)
"""
from __future__ import annotations

import functools

from ..config import Config
from ..context_parallel.ring import needed_rows
from ..context_parallel.ulysses_docs import plan_documents
from ..model.documents import attended_share

Bounds = tuple[tuple[int, ...], ...]


def planned_document_length(cfg: Config) -> int | None:
    """L of the plan: --plan-document-length (at most --seq-length), else --seq-length; None without the mask."""
    if not cfg.data.reset_attention_mask:
        return None
    return min(cfg.data.plan_document_length or cfg.model.seq_length, cfg.model.seq_length)


def planned_bounds(seq_length: int, document_length: int) -> Bounds:
    """One sample of ``seq_length`` tokens cut into documents of ``document_length`` (cu_seqlens)."""
    cuts = list(range(0, seq_length, document_length))
    return (tuple(cuts + [seq_length]),)


@functools.lru_cache(maxsize=256)
def a2a_shared_tokens(seq_length: int, document_length: int, ranks: int) -> int:
    """Tokens per planned sample whose documents travel under all-to-all of ``ranks`` (the rest stay home:
    ``context_parallel.ulysses_docs``); each rank keeps its heads' q, k, v, output and lse of them."""
    plan = plan_documents(planned_bounds(seq_length, document_length), ranks, 0, seq_length // ranks)
    return plan.shared_tokens


def square_sum(seq_length: int, document_length: int | None) -> int:
    """sum_d L_d^2 over one planned sample (S^2 without the mask: ``document_length`` None)."""
    if document_length is None:
        return seq_length * seq_length
    cuts = planned_bounds(seq_length, document_length)[0]
    return sum((e - s) ** 2 for s, e in zip(cuts[:-1], cuts[1:]))


@functools.lru_cache(maxsize=256)
def planned_attended_share(seq_length: int, document_length: int | None, ring: int = 1) -> float | None:
    """The attention core's share of the causal pairs on the busiest rank (None: no document mask).

    Under a ring of ``ring`` positions (cp / U; the all-to-all alone attends whole sequences) each
    position computes its two load-balanced chunks' queries against every key; the largest share
    sets the step.
    """
    if document_length is None:
        return None
    bounds = planned_bounds(seq_length, document_length)
    if ring == 1:
        return attended_share([bounds])
    return max(attended_share([bounds], (rank, ring)) for rank in range(ring))


@functools.lru_cache(maxsize=256)  # the layout search asks for the same few rings many times
def ring_hop_shares(seq_length: int, ring: int, document_length: int | None) -> tuple[float, float]:
    """(K/V rows over a block's R - 1 hops, dK/dV accumulator rows over its R - 1 hops), in units of one ring
    position's rows, each hop at its busiest sender: a hop of rank src's K/V carries the rows some rank
    still ahead uses (``context_parallel.ring.needed_rows``; unmasked, all but rank 0's late chunk), and
    the accumulator travels the rows of the first hop."""
    local = seq_length // ring
    bounds = None if document_length is None else planned_bounds(seq_length, document_length)

    def rows(src: int, hop: int) -> int:
        ahead = tuple((src + h) % ring for h in range(hop, ring))
        return sum(hi - lo for lo, hi in needed_rows(src, ahead, ring, local, True, bounds))

    hops = sum(max(rows(src, hop) for src in range(ring)) for hop in range(1, ring))
    return hops / local, (ring - 1) * max(rows(src, 1) for src in range(ring)) / local


def document_lines(cfg: Config, ring: int = 1) -> list[str]:
    """The planner's line on the mask (none without it): what the figures assume."""
    length = planned_document_length(cfg)
    if length is None:
        return []
    seq = cfg.model.seq_length
    upper = " (--seq-length: one document per sample, the upper bound)" if length == seq else ""
    return [f"documents: --reset-attention-mask, planned as documents of {length} tokens{upper}; attention "
            f"work x {planned_attended_share(seq, length, ring):.3f} of causal, math-kernel scores per document "
            f"(S_d x S_d); --plan-document-length sets it"]
