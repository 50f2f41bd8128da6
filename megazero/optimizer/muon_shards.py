"""Muon on the ZeRO shards (``--optimizer muon``): the momentum where AdamW keeps exp_avg, each matrix's
Newton-Schulz (NS) once per step on one owner rank, the AdamW path for every other parameter.

``zero.DistributedOptimizer.step`` has reduced the grads into the shards, unscaled them, taken the global norm
and the clip coefficient (AdamW's order); then ``ShardedMuon.first`` on every piece the store's sweep hands out
(a bucket's whole shard, or with the disk tier a part of it; ``zero.DistributedOptimizer._muon_step``):

    1. clip the grad shard; AdamW on its AdamW runs (lr ``OptimizerConfig.adam_lr``); Muon's momentum and
       direction on its Muon runs - both elementwise, so the shard suffices (exp_avg holds Muon's momentum;
       the store keeps exp_avg_sq for the AdamW runs alone, compact: ``kept``, ``pieces.compact_runs``);
    2. send each matrix's direction elements to its owner alone (``muon_routes.gather_routes``: point-to-point,
       one batch per bucket), where its TP pieces are joined along the weight's split dim (``spec_of``): the
       full, unfused-layout weight whose matrices ``muon.matrices_of`` names (a fused qkv split over TP by groups
       joins back group by group), zero where the matrices are other ranks';
    3. NS on the matrices this rank owns (``assign_owners``: longest-processing-time packing of NS cost
       m * n * min(m, n) over the weight's holders, below) - the same inputs on the same owner as an all-gather;
(2 and 3 once the bucket's last piece is in); then 4. ``share``: each owner sends its NS outputs' elements to
the ranks holding them (``scatter_routes``, one batch per holder set), and ``second``, on every piece of a
second sweep: each rank decays its shard of every Muon weight (``w *= 1 - lr * wd``) and adds
``-adjusted_lr * NS`` to its elements (offloaded state: where it lives).
The engine then all-gathers the updated parameter shards as for AdamW.

Owners: the ranks that hold copies of a weight (its ``Holders``): a dense weight's are its pipeline stage's
dp x cp x tp ranks (its buffer's reduction group, dp x cp, times the TP group); a routed expert's the edp x etp
ranks of its expert-parallel rank and stage (the expert buffer's reduction group, edp, times the ETP group). Every
rank belongs to one dense and (MoE) one expert set; each set numbers its own matrices, packs them over its own
ranks and routes its elements among them, over the world group (its peers' global ranks from the layout: no
process group beyond the run's). Traffic each rank sends per step, in fp32 elements: its shard's elements of
matrices others own, plus its owned matrices' elements other ranks hold (at ZeRO >= 1 and tp 1 about
2 (R - 1) / R of its shard's Muon elements, R the reduction group's size). The ledger counts these sends as
``send.muon``; ``memory/muon_traffic.py`` predicts them from the config, rank by rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig, OptimizerConfig
from ..data_parallel.buffers import ParamGradBuffer
from ..data_parallel.layout import Bucket, Segment
from ..data_parallel.reduction import ReductionGroup
from ..parallel import collectives as C
from ..parallel.collectives import Group
from ..parallel.state import ParallelState, group_size
from ..tensor_parallel.layers import full_shape, spec_of
from .adam import AdamHyper, adamw_shard_step
from .pieces import compact_runs, runs_in
from .muon_routes import Routes, WeightGeometry, gather_routes, scatter_routes, sent
from .muon import (Matrix, adjusted_lr, add_to_matrix_, matrices_of, matrix_shape, momentum_direction_, muon_hyper,
                   newton_schulz, ns_cost, take_matrix, takes_muon)

PHASE = "muon"  # the ledger's kind for Muon's sends: send.muon


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """Longest-processing-time packing: the costliest matrix first, each to the least-loaded rank (the lower on a
    tie). Every rank computes the same owners from the same shapes."""
    loads, owners = [0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i], loads[rank] = rank, loads[rank] + costs[i]
    return owners


@dataclass
class Holders:
    """The ranks that hold copies of one set of Muon weights (a stage's dense weights, or one expert-parallel
    rank's experts): the buffers' reduction group times the (E)TP group, a grid, so rank ``reduction.rank * tp +
    tp_rank`` of the set is reached by gathering over the TP group and then over the reduction group.
    ``shapes``: the set's matrices, numbered bucket by bucket, weight by weight; ``owners``: each one's rank."""

    reduction: ReductionGroup
    tp_group: Group
    tp_rank: int
    shapes: list[tuple[int, int]] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    owned_by: list[list[int]] = field(default_factory=list)
    width: int = 0  # the most matrix elements any rank of the set owns
    peers: list[int] = field(default_factory=list)  # the global rank of each set rank

    @property
    def tp(self) -> int:
        return group_size(self.tp_group)

    @property
    def ranks(self) -> int:
        return self.reduction.size * self.tp

    @property
    def rank(self) -> int:
        return self.reduction.rank * self.tp + self.tp_rank

    def assign(self) -> None:
        """Pack the set's matrices over its ranks by NS cost, once every matrix is numbered."""
        self.owners = assign_owners([ns_cost(s) for s in self.shapes], self.ranks)
        self.owned_by = [[k for k, r in enumerate(self.owners) if r == rank] for rank in range(self.ranks)]
        self.width = max((sum(self.shapes[k][0] * self.shapes[k][1] for k in ks) for ks in self.owned_by), default=0)


@dataclass(frozen=True)
class MuonWeight:
    """One Muon parameter: where it sits in its bucket, its full (TP-joined) shape and its matrices; ``first``:
    the index of its first matrix among its ``holders``' matrices."""

    param: nn.Parameter
    offset: int  # its first element in the bucket, bucket coordinates
    full_shape: tuple[int, ...]
    matrices: tuple[Matrix, ...]
    first: int
    holders: Holders


class ShardedMuon:
    """Muon for the Muon parameters of ``bucket_list``'s buckets, AdamW for the rest; ``reductions``: each bucket's
    reduction group (its shards are spread over it); ``names``: each parameter's name in its chunk (the split rule
    and the fused-weight rule read it). ``ns_calls`` counts this rank's NS calls."""

    def __init__(self, bucket_list: list[tuple[ParamGradBuffer, Bucket]], reductions: list[ReductionGroup],
                 names: dict[nn.Parameter, str], model: ModelConfig, cfg: OptimizerConfig,
                 pstate: ParallelState) -> None:
        self.cfg, self.pstate, self.bucket_list, self.reductions = cfg, pstate, bucket_list, reductions
        muon = {p for p in names if takes_muon(names[p], p)}
        self.holders: dict[bool, Holders] = {}  # dense (False) and expert (True) weights' holders
        self.weights: list[list[MuonWeight]] = []
        for (buf, b), reduction in zip(bucket_list, reductions):
            if buf.expert not in self.holders:
                tp_group, tp_rank = (pstate.etp_group, pstate.etp_rank) if buf.expert else \
                    (pstate.tp_group, pstate.tp_rank)
                self.holders[buf.expert] = Holders(reduction, tp_group, tp_rank)
            holders = self.holders[buf.expert]
            here = []
            for p in b.params:
                if p not in muon:
                    continue
                assert spec_of(p).expert == buf.expert, f"{names[p]}: an expert weight outside an expert buffer"
                shape = full_shape(p, holders.tp)
                matrices = matrices_of(names[p], shape, model)
                here.append(MuonWeight(p, buf.offsets[p] - b.offset, shape, matrices, len(holders.shapes), holders))
                holders.shapes.extend(matrix_shape(shape, m) for m in matrices)
            self.weights.append(here)
        for expert, holders in self.holders.items():
            holders.assign()
            holders.peers = _peers(pstate, holders, expert)
        self.routes = [self._bucket_routes(i) for i in range(len(bucket_list))]  # (gather, scatter) per bucket
        # per bucket: each Muon weight with its pieces in this rank's shard; the shard's Muon and AdamW runs
        self.pieces: list[list[tuple[MuonWeight, list[Segment]]]] = [
            [(w, [s for s in b.segments if s.param is w.param]) for w in here]
            for here, (_, b) in zip(self.weights, bucket_list)]
        # One range per piece of a parameter, not runs merged across parameters: an elementwise CPU kernel rounds
        # its last (numel % vector width) elements in a scalar loop, so with one process these are the ranges
        # torch's per-tensor optimizers run, bit for bit; NS amplifies a rounding difference ~a^5 = 490x per step.
        self.muon_runs = [[(s.lo, s.hi) for s in b.segments if s.param in muon] for _, b in bucket_list]
        self.adam_runs = [([(s.lo, s.hi) for s in b.segments if s.param not in muon and s.decay],
                           [(s.lo, s.hi) for s in b.segments if s.param not in muon and not s.decay])
                          for _, b in bucket_list]
        self.ns_calls = 0
        self._piece_runs: dict[tuple[int, int, int], tuple] = {}

    @property
    def matrices(self) -> int:
        """Muon matrices of this rank's chunks: the NS calls one step makes over the ranks holding them."""
        return sum(len(h.shapes) for h in self.holders.values())

    def step_bytes(self) -> int:
        """Bytes this rank sends per step along Muon's routes (gather and scatter; what the ledger counts as
        ``send.muon``): the module docstring's formula, in bytes."""
        elements = 0
        for (buf, _), routes in zip(self.bucket_list, self.routes):
            rank = self.holders[buf.expert].rank
            elements += sum(sent(r, rank) for r in routes)
        return 4 * elements

    def _bucket_routes(self, i: int) -> tuple[Routes, Routes]:
        """Bucket ``i``'s (gather, scatter) routes over its holder set (``muon_routes``; none without Muon)."""
        buf, b = self.bucket_list[i]
        if not self.weights[i]:
            return {}, {}
        h = self.holders[buf.expert]
        geometry = [WeightGeometry(w.offset, w.full_shape, spec_of(w.param).split_dim, w.matrices, w.first)
                    for w in self.weights[i]]
        args = (geometry, b.numel, h.owners, h.reduction.size, h.tp, buf.num_shards)
        return gather_routes(*args), scatter_routes(*args)

    def kept(self, i: int) -> list[tuple[int, int]]:
        """Bucket ``i``'s shard ranges that keep a second moment: its AdamW segments (the store's ``kept``)."""
        return sorted(self.adam_runs[i][0] + self.adam_runs[i][1])

    def _runs(self, i: int, lo: int, hi: int) -> tuple:
        """The piece [lo, hi) of bucket ``i``: its AdamW runs, where they sit in its compact second moment, and its
        Muon runs, in piece coordinates (computed once per piece: the cuts are fixed)."""
        key = (i, lo, hi)
        if key not in self._piece_runs:
            adam = self.adam_runs[i] if (lo, hi) == (0, self.bucket_list[i][1].shard_numel) else \
                runs_in(self.adam_runs[i], lo, hi)
            muon = runs_in((self.muon_runs[i], []), lo, hi)[0]
            self._piece_runs[key] = adam, compact_runs(adam, self.kept(i), lo), muon
        return self._piece_runs[key]

    def begin(self, lr: float) -> None:
        """Start a step at the scheduled ``lr``: ``first`` on every piece, ``share``, then ``second`` on every piece."""
        c = self.cfg
        self._hyper = muon_hyper(c, lr)
        self._adam = AdamHyper(lr=c.adam_lr(lr), weight_decay=c.weight_decay, beta1=c.adam_beta1,
                               beta2=c.adam_beta2, eps=c.adam_eps)
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, matrix number): NS of what this rank owns
        self._direction: torch.Tensor | None = None

    @torch.no_grad()
    def first(self, i: int, lo: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor], g: torch.Tensor,
              step: int) -> None:
        """Piece [lo, lo + n) of bucket ``i``: AdamW on its AdamW runs (``step``: the bias-correction count), Muon's
        momentum and direction on its Muon runs; at the bucket's last piece, its weights' NS. ``g``: the piece's fp32
        grad, clipped."""
        master, exp_avg, exp_avg_sq = views
        hi = lo + master.numel()
        adam, sq, muon = self._runs(i, lo, hi)
        adamw_shard_step(master, g, exp_avg, exp_avg_sq, adam, self._adam, step, sq)
        if not self.weights[i]:  # the same buckets on every holder: no Muon weight, no gather
            return
        shard = self.bucket_list[i][1].shard_numel
        if lo == 0:
            self._direction = torch.zeros(shard, dtype=torch.float32, device=self.pstate.device)
        direction = self._direction
        assert direction is not None, "a bucket's pieces are swept from offset 0"
        for a, b in muon:
            direction[lo + a:lo + b] = momentum_direction_(g[a:b], exp_avg[a:b], self._hyper)
        if hi < shard:
            return
        h = self._hyper
        for weight, full in zip(self.weights[i], self._gather(i, direction)):
            holders = weight.holders
            for k, m in enumerate(weight.matrices, start=weight.first):
                if holders.owners[k] == holders.rank:
                    assert full is not None, "an owner holds its weight's gathered direction"
                    self._outputs[(i, k)] = newton_schulz(take_matrix(full, m), h.ns_steps, h.ns_coefficients,
                                                          h.eps, h.ns_dtype).float()
                    self.ns_calls += 1
        self._direction = None

    def share(self) -> None:
        """Each owner's NS outputs to the ranks holding their elements (after ``first`` on every piece): one batch
        of sends per holder set, dense set first; each rank keeps its weights' updates (``_receive``)."""
        self._updates: dict[int, list[tuple[float, torch.Tensor]]] = {}
        for expert, h in self.holders.items():
            buckets = [i for i, (buf, _) in enumerate(self.bucket_list) if buf.expert == expert and self.weights[i]]
            sends: dict[int, list[torch.Tensor]] = {}
            for i in buckets:
                cache: dict = {}
                for (src, dst), pieces in self.routes[i][1].items():
                    if src == h.rank:
                        sends.setdefault(dst, []).append(torch.cat([self._owned(i, wi, t, cache)[lo:hi]
                                                                    for wi, _, t, lo, hi in pieces]))
            got = self._exchange(h, {d: torch.cat(t) for d, t in sends.items()},
                                 [(i, self.routes[i][1]) for i in buckets])
            for i in buckets:
                self._receive(i, got)
        self._outputs = {}

    @torch.no_grad()
    def second(self, i: int, lo: int, master: torch.Tensor) -> None:
        """Piece [lo, lo + n) of bucket ``i``'s master: decay its Muon runs and add their weights' updates."""
        hi = lo + master.numel()
        _, _, muon = self._runs(i, lo, hi)
        decay = 1 - self._hyper.lr * self._hyper.weight_decay
        for a, b in muon:
            master[a:b].mul_(decay)
        for weight, segments in self.pieces[i]:
            here = [s for s in segments if s.lo < hi and s.hi > lo]
            if not here:
                continue
            for alpha, update in self._updates[id(weight)]:
                for s in here:
                    a, b = max(s.lo, lo), min(s.hi, hi)
                    part = update[s.param_lo + a - s.lo:s.param_lo + b - s.lo]
                    master[a - lo:b - lo].add_(part.to(master.device), alpha=alpha)

    def end(self) -> None:
        """Drop the step's shared updates."""
        self._updates = {}


    def _gather(self, i: int, direction: torch.Tensor) -> list[torch.Tensor | None]:
        """Bucket ``i``'s direction pieces to their matrices' owners; per weight, the full (TP-joined) direction
        on this rank where it owns one of the weight's matrices (zero where its matrices are others'), else None."""
        buf, b = self.bucket_list[i]
        h, routes, weights = self.holders[buf.expert], self.routes[i][0], self.weights[i]
        base = h.reduction.rank * b.shard_numel if buf.num_shards > 1 else 0
        sends = {dst: torch.cat([direction[weights[wi].offset + lo - base:weights[wi].offset + hi - base]
                                 for wi, _, _, lo, hi in pieces])
                 for (src, dst), pieces in routes.items() if src == h.rank}
        got = self._exchange(h, sends, [(i, routes)])
        local: dict[tuple[int, int], torch.Tensor] = {}  # (weight, TP piece) -> its flat direction
        for (src, dst), pieces in routes.items():
            if dst != h.rank:
                continue
            data, at = got[(i, src)], 0
            for wi, _, t, lo, hi in pieces:
                if (wi, t) not in local:
                    local[(wi, t)] = direction.new_zeros(weights[wi].param.numel())
                local[(wi, t)][lo:hi] = data[at:at + hi - lo]
                at += hi - lo
        out: list[torch.Tensor | None] = []
        for wi, w in enumerate(weights):
            dim, shape = spec_of(w.param).split_dim, w.param.shape
            if not any(h.owners[k] == h.rank for k in range(w.first, w.first + len(w.matrices))):
                out.append(None)
            elif dim is None:
                out.append(local[(wi, h.tp_rank)].view(shape))
            else:
                out.append(torch.cat([local.get((wi, t), direction.new_zeros(w.param.numel())).view(shape)
                                      for t in range(h.tp)], dim=dim))
        return out

    def _exchange(self, h: Holders, sends: dict[int, torch.Tensor],
                  routes: list[tuple[int, Routes]]) -> dict[tuple[int, int], torch.Tensor]:
        """Send ``sends`` (set rank -> one tensor; this rank's own is kept) and receive what ``routes`` (per
        bucket) bring here, one batch of point-to-point ops over the world group; (bucket, sender) -> elements."""
        me, group = h.rank, self.pstate.world_group
        sizes: dict[int, list[tuple[int, int]]] = {}
        for i, r in routes:
            for (src, dst), pieces in r.items():
                if dst == me:
                    sizes.setdefault(src, []).append((i, sum(hi - lo for *_, lo, hi in pieces)))
        whole = {me: sends.pop(me)} if me in sends else {}
        ops = []
        for src, parts in sizes.items():
            if src != me:
                whole[src] = torch.empty(sum(n for _, n in parts), dtype=torch.float32, device=self.pstate.device)
                ops.append(dist.P2POp(dist.irecv, whole[src], h.peers[src], group))
        ops += [dist.P2POp(dist.isend, t, h.peers[dst], group) for dst, t in sends.items()]
        for work in C.batch_isend_irecv(ops, group, phase=PHASE):
            work.wait()
        out = {}
        for src, parts in sizes.items():
            at = 0
            for i, n in parts:
                out[(i, src)], at = whole[src][at:at + n], at + n
        return out

    def _owned(self, i: int, wi: int, t: int, cache: dict) -> torch.Tensor:
        """TP piece ``t`` (flat) of weight ``wi`` of bucket ``i`` holding the NS outputs of its matrices this rank
        owns (placed as ``add_to_matrix_`` places them in zeros, as every rank did under the all-gather scheme)."""
        if (wi, t) not in cache:
            w = self.weights[i][wi]
            if wi not in cache:
                full = torch.zeros(w.full_shape, dtype=torch.float32, device=self.pstate.device)
                for k, m in enumerate(w.matrices, start=w.first):
                    if (i, k) in self._outputs:
                        add_to_matrix_(full, m, self._outputs[(i, k)])
                cache[wi] = full
            dim, local = spec_of(w.param).split_dim, w.param.shape
            piece = cache[wi] if dim is None else cache[wi].narrow(dim, t * local[dim], local[dim])
            cache[(wi, t)] = piece.reshape(-1)
        return cache[(wi, t)]

    def _receive(self, i: int, got: dict[tuple[int, int], torch.Tensor]) -> None:
        """This rank's updates of bucket ``i``'s weights from the owners' pieces: per weight, (-adjusted lr, its
        matrices of that lr placed in zeros, flat, this rank's TP piece) in the matrices' order, so that
        ``w.add_(update, alpha)`` is the one rounding ``muon_step_`` makes (and adds an exact zero elsewhere)."""
        buf, _ = self.bucket_list[i]
        h, lr = self.holders[buf.expert], self._hyper.lr
        mine: dict[int, dict[float, torch.Tensor]] = {}
        for (src, dst), pieces in self.routes[i][1].items():
            if dst != h.rank:
                continue
            data, at = got[(i, src)], 0
            for wi, k, _, lo, hi in pieces:
                w = self.weights[i][wi]
                if wi not in mine:
                    mine[wi] = {}
                    for j in range(w.first, w.first + len(w.matrices)):
                        alpha = -adjusted_lr(lr, h.shapes[j], self.cfg.muon_lr_adjust)
                        if alpha not in mine[wi]:
                            mine[wi][alpha] = data.new_zeros(w.param.numel())
                alpha = -adjusted_lr(lr, h.shapes[k], self.cfg.muon_lr_adjust)
                mine[wi][alpha][lo:hi] = data[at:at + hi - lo]
                at += hi - lo
        for wi, by_alpha in mine.items():
            self._updates[id(self.weights[i][wi])] = list(by_alpha.items())


def _peers(pstate: ParallelState, h: Holders, expert: bool) -> list[int]:
    """The global rank of each rank ``s * tp + t`` of a holder set (reduction rank s, (E)TP rank t)."""
    if h.ranks == 1:
        return [pstate.rank]
    layout, pp = pstate.layout, pstate.pp_rank
    if expert:
        ep = pstate.ep_rank
        peers = [layout.expert.rank(t, ep, s, pp) for s in range(h.reduction.size) for t in range(h.tp)]
    else:
        peers = [layout.rank(t, s // layout.cp, pp, s % layout.cp) for s in range(h.reduction.size)
                 for t in range(h.tp)]
    assert peers[h.rank] == pstate.rank, "the holder set is not the (reduction x TP) grid of the layout"
    return peers
