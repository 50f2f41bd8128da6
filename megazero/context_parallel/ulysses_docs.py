"""All-to-all attention under document masks: a document stays with the rank that holds it where it can.

Pure a2a splits the sequence contiguously: rank r holds tokens [r·s, (r+1)·s). A document lying wholly
in one rank's tokens needs nothing from the others, so that rank computes it for every head, with no
exchange at all. Only the documents that straddle ranks, and as many home documents as balancing the
work needs, go the Ulysses way: their tokens' q, k and v travel as head shards (rank r gets heads
r·n/U .. (r+1)·n/U - 1 of every shared token), each rank runs those documents whole for its heads, and
the outputs travel back. Backward mirrors it with dout and dq/dk/dv. The exchange thus carries the
shared documents' tokens only (``DocumentPlan.shared_tokens``), where Ulysses carries every token.

Every rank derives the same plan from the bounds (``plan_documents``): a document's work is its causal
pairs, a rank's load is its home documents plus 1/U of the shared ones, and while the busiest rank is
more than 3% over the mean, its home document whose sharing lowers the maximum most is shared.
The exchange of shared q/k/v travels while the home documents are computed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel import collectives
from ..parallel.collectives import Group
from .blocks import acc_dtype, block_backward, block_forward
from .doc_blocks import Bounds
from .logit_max import LogitMax

Doc = tuple[int, int, int]  # (sample, global start, global stop)
_BALANCE = 1.03  # share home documents until the busiest rank is within 3% of the mean


def _pairs(doc: Doc) -> int:
    n = doc[2] - doc[1]
    return n * (n + 1) // 2


def _owner(doc: Doc, local_len: int) -> int | None:
    first, last = doc[1] // local_len, (doc[2] - 1) // local_len
    return first if first == last else None


def _balance(home: list[list[Doc]], shared: list[Doc], ranks: int) -> None:
    """Move home documents to ``shared`` (in place) while that lowers the busiest rank's load enough."""
    load = [sum(_pairs(d) for d in docs) for docs in home]
    common = sum(_pairs(d) for d in shared) / ranks
    mean = sum(load) / ranks + common
    while max(load) + common > _BALANCE * mean:
        r = max(range(ranks), key=lambda x: load[x])
        best, best_max = None, max(load) + common
        for doc in home[r]:
            w = _pairs(doc)
            new_max = max(load[x] - (w if x == r else 0) for x in range(ranks)) + common + w / ranks
            if new_max < best_max:
                best, best_max = doc, new_max
        if best is None:
            return
        home[r].remove(best)
        shared.append(best)
        load[r] -= _pairs(best)
        common += _pairs(best) / ranks


@dataclass(frozen=True)
class DocumentPlan:
    """This rank's side of the plan.

    home: its documents, as (sample, heads, local tokens) rows of its [b, n, s, d] tensors.
    sample, position: its tokens in shared documents ([t] each, in (sample, position) order): what it sends.
    counts: every rank's t (the rows each source sends; the all-to-all's splits).
    order: received rows (source by source) -> the shared documents' tokens, document by document.
    spans: each shared document's run of those tokens, in that order.
    """

    home: tuple[tuple[slice, slice, slice], ...]
    sample: torch.Tensor
    position: torch.Tensor
    counts: tuple[int, ...]
    order: torch.Tensor
    spans: tuple[slice, ...]

    @property
    def shared_tokens(self) -> int:
        return self.spans[-1].stop if self.spans else 0


@functools.lru_cache(maxsize=64)
def plan_documents(bounds: Bounds, ranks: int, rank: int, local_len: int,
                   device: torch.device | None = None) -> DocumentPlan:
    """Which documents rank ``rank`` computes alone and how the shared ones' tokens travel (module docstring);
    its index tensors made once on ``device``."""
    docs = [(i, a, b) for i, cuts in enumerate(bounds) for a, b in zip(cuts[:-1], cuts[1:])]
    home: list[list[Doc]] = [[] for _ in range(ranks)]
    shared: list[Doc] = []
    for doc in docs:
        owner = _owner(doc, local_len)
        (shared if owner is None else home[owner]).append(doc)
    _balance(home, shared, ranks)
    shared.sort()
    tokens: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]  # per rank: (sample, local position)
    where: list[list[tuple[int, int]]] = []  # per shared document: the received row of each of its tokens, in order
    for i, a, b in shared:
        rows: list[tuple[int, int]] = []
        for r in range(a // local_len, (b - 1) // local_len + 1):
            lo, hi = max(a, r * local_len), min(b, (r + 1) * local_len)
            rows += [(r, len(tokens[r]) + j) for j in range(hi - lo)]
            tokens[r] += [(i, p - r * local_len) for p in range(lo, hi)]
        where.append(rows)
    offsets = [sum(len(t) for t in tokens[:r]) for r in range(ranks)]
    starts = [sum(b - a for _, a, b in shared[:j]) for j in range(len(shared) + 1)]
    mine = tokens[rank]
    return DocumentPlan(
        home=tuple((slice(i, i + 1), slice(None), slice(a - rank * local_len, b - rank * local_len))
                   for i, a, b in home[rank]),
        sample=torch.tensor([i for i, _ in mine], dtype=torch.long, device=device),
        position=torch.tensor([p for _, p in mine], dtype=torch.long, device=device),
        counts=tuple(len(t) for t in tokens),
        order=torch.tensor([offsets[r] + j for rows in where for r, j in rows], dtype=torch.long, device=device),
        spans=tuple(slice(a, b) for a, b in zip(starts[:-1], starts[1:])))


def _tokens(t_bnsd: torch.Tensor, plan: DocumentPlan, u: int) -> torch.Tensor:
    """This rank's shared tokens of ``t``, heads by destination: [u, t, n/u, d] (a view of one gathered copy)."""
    b, n, s, d = t_bnsd.shape
    rows = t_bnsd.transpose(1, 2).view(b, s, u, n // u, d)[plan.sample, plan.position]
    return rows.transpose(0, 1)


def _start(parts: list[torch.Tensor], in_splits: list[int], out_splits: list[int], group: Group) -> tuple:
    """One all-to-all of ``parts`` ([rows, c_i, d] each, or [u, t, c_i, d]) side by side: (receive buffer, work)."""
    send = torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0].contiguous()
    send = send.view(-1, *send.shape[-2:])
    recv = send.new_empty((sum(out_splits), *send.shape[1:]))
    return recv, collectives.all_to_all_single(recv, send, group, async_op=True, out_splits=out_splits,
                                               in_splits=in_splits)


def _outbound(plan: DocumentPlan, group: Group, u: int) -> tuple[list[int], list[int]]:
    """Splits of the exchange to the shared documents' ranks: send t to each, receive each source's count."""
    return [plan.counts[dist.get_rank(group)]] * u, list(plan.counts)


def _documents(recv: torch.Tensor, plan: DocumentPlan) -> torch.Tensor:
    """Received rows [rows, c, d] -> the shared documents' tokens, heads first: [c, T, d]."""
    return recv.transpose(0, 1)[:, plan.order]


def _to_sources(t_ctd: torch.Tensor, plan: DocumentPlan) -> torch.Tensor:
    """The inverse of ``_documents``: [c, T, d] -> rows in the order received, [rows, c, d]."""
    rows = t_ctd.new_empty(t_ctd.shape[1], t_ctd.shape[0], t_ctd.shape[2])
    rows.transpose(0, 1)[:, plan.order] = t_ctd
    return rows


def _put(dst_bnsd: torch.Tensor, recv: torch.Tensor, u: int, plan: DocumentPlan) -> None:
    """Write the returned rows ([u·t, w, d], source r holding heads r) at this rank's shared tokens."""
    b, n, s, d = dst_bnsd.shape
    t = recv.shape[0] // u
    dst_bnsd.transpose(1, 2).view(b, s, u, n // u, d)[plan.sample, plan.position] = \
        recv.view(u, t, *recv.shape[1:]).transpose(0, 1)


class _DocumentsA2A(torch.autograd.Function):
    """Forward/backward of the module docstring's scheme (q, k, v: this rank's [b, heads, s, d])."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                bounds: Bounds, logit_max: LogitMax | None = None) -> torch.Tensor:
        u, me = dist.get_world_size(group), dist.get_rank(group)
        plan = plan_documents(bounds, u, me, q.shape[2], q.device)
        widths = (q.shape[1] // u, k.shape[1] // u, v.shape[1] // u)
        pending = _start([_tokens(t, plan, u) for t in (q, k, v)], *_outbound(plan, group, u), group) \
            if plan.shared_tokens else None
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))
        for rows in plan.home:  # while the shared documents' tokens travel
            if logit_max is not None:  # every head of a home document
                logit_max.add_blocks(q[rows], k[rows], True)
            out[rows], lse[rows] = block_forward(q[rows], k[rows], v[rows], True)
        shared: tuple[torch.Tensor, ...] = ()
        if pending is not None:
            recv, work = pending
            work.wait()
            qs, ks, vs = _documents(recv, plan).split(widths, dim=0)
            out_s = torch.empty_like(qs)
            lse_s = qs.new_empty(qs.shape[:2], dtype=acc_dtype(q.dtype))
            for span in plan.spans:
                if logit_max is not None:  # this rank's head shard of a shared document
                    logit_max.add_blocks(qs[:, span].unsqueeze(0), ks[:, span].unsqueeze(0), True, me * widths[0])
                o, l_ = block_forward(qs[:, span].unsqueeze(0), ks[:, span].unsqueeze(0), vs[:, span].unsqueeze(0),
                                      True)
                out_s[:, span], lse_s[:, span] = o[0], l_[0]
            to_owner, from_owner = _outbound(plan, group, u)
            back, work = _start([_to_sources(out_s, plan)], from_owner, to_owner, group)
            work.wait()
            _put(out, back, u, plan)
            shared = (qs, ks, vs, out_s, lse_s)
        ctx.save_for_backward(q, k, v, out, lse, *shared)
        ctx.group, ctx.plan, ctx.widths = group, plan, widths
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, *shared = ctx.saved_tensors
        group, plan = ctx.group, ctx.plan
        u = dist.get_world_size(group)
        dout = dout.contiguous()
        pending = _start([_tokens(dout, plan, u)], *_outbound(plan, group, u), group) if shared else None
        grads = [torch.empty_like(t) for t in (q, k, v)]
        for rows in plan.home:
            for grad, part in zip(grads, block_backward(dout[rows], q[rows], k[rows], v[rows], out[rows], lse[rows],
                                                        True)):
                grad[rows] = part
        if pending is not None:
            qs, ks, vs, out_s, lse_s = shared
            recv, work = pending
            work.wait()
            dout_s = _documents(recv, plan)
            grads_s = dout_s.new_empty(sum(ctx.widths), *dout_s.shape[1:])
            parts = grads_s.split(ctx.widths, dim=0)
            for span in plan.spans:
                q1, k1, v1, o1, l1, d1 = (t[:, span].unsqueeze(0) for t in (qs, ks, vs, out_s, lse_s, dout_s))
                got = block_backward(d1, q1, k1, v1, o1, l1, True)
                for part, g in zip(parts, got):
                    part[:, span] = g[0]
            to_owner, from_owner = _outbound(plan, group, u)
            back, work = _start([_to_sources(grads_s, plan)], from_owner, to_owner, group)
            work.wait()
            for grad, returned in zip(grads, back.split(ctx.widths, dim=1)):
                _put(grad, returned, u, plan)
        return (*grads, None, None, None)


def document_a2a_attention(q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor,
                           group: Group, bounds: Bounds, logit_max: LogitMax | None = None) -> torch.Tensor:
    """Causal attention inside the documents of ``bounds`` over a contiguous split; kv heads divisible by the
    group's size (``ulysses.replicate_kv_heads``). ``logit_max`` (QK-clip): the per-head maximum logit."""
    return _DocumentsA2A.apply(q_bnsd.contiguous(), k_bgsd.contiguous(), v_bgsd.contiguous(), group, bounds,
                               logit_max)
