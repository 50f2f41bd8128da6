"""Muon on the ZeRO shards (``--optimizer muon``): the momentum where AdamW keeps exp_avg, each matrix's
Newton-Schulz (NS) once per step on one owner rank, the AdamW path for every other parameter.

``zero.DistributedOptimizer.step`` has reduced the grads into the shards, unscaled them, taken the global norm
and the clip coefficient (AdamW's order); then ``ShardedMuon.step``, for every bucket in the store's order:

    1. clip the grad shard; AdamW on its AdamW runs (lr ``OptimizerConfig.adam_lr``); Muon's momentum and
       direction on its Muon runs - both elementwise, so the shard suffices (exp_avg holds Muon's momentum;
       the Muon elements' exp_avg_sq stays zero);
    2. assemble each Muon weight's direction whole: all-gather the bucket's direction shards over its reduction
       group (ZeRO 1/2; at ZeRO 0 the shard is the bucket), then the bucket over the TP group, and cut each
       weight's TP pieces out and join them along its split dim (``spec_of``): the full, unfused-layout weight
       whose matrices ``muon.matrices_of`` names (a fused qkv split over TP by groups joins back group by group);
    3. NS on the matrices this rank owns (``assign_owners``: longest-processing-time packing of NS cost
       m * n * min(m, n) over the weight's holders, below, which all hold its direction after step 2);
then 4. the holders share their NS outputs (each rank's padded to the largest rank's), and each rank
decays its shard of every Muon weight (``w *= 1 - lr * wd``) and adds ``-adjusted_lr * NS`` to its elements.
The engine then all-gathers the updated parameter shards as for AdamW.

Owners: the ranks that hold copies of a weight (its ``Holders``): a dense weight's are its pipeline stage's
dp x cp x tp ranks (its buffer's reduction group, dp x cp, times the TP group); a routed expert's the edp x etp
ranks of its expert-parallel rank and stage (the expert buffer's reduction group, edp, times the ETP group). Every
rank belongs to one dense and (MoE) one expert set; each set numbers its own matrices, packs them over its own
ranks and shares its NS outputs among them, gathered over the TP (ETP) group, then over the reduction group (a
two-stage all-gather: no process group beyond the run's). Traffic each rank receives per step, in fp32
elements, per set with W = (reduction group) x (TP group) ranks: B (R - 1) / R at ZeRO 1/2 (0 at ZeRO 0), with B
the TP-local elements (padding included) of the set's buckets holding a Muon weight and R the reduction group's
size, + B (tp - 1), + (W - 1) max_r M_r, with M_r the matrix elements rank r of the set owns. The ledger counts
these gathers as ``all_gather.muon``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
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
from .muon import (Matrix, adjusted_lr, add_to_matrix_, matrices_of, matrix_shape, momentum_direction_, muon_hyper,
                   newton_schulz, ns_cost, take_matrix, takes_muon)

PHASE = "muon"  # the ledger's kind for Muon's gathers: all_gather.muon


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
    width: int = 0  # the most matrix elements any rank of the set owns: each rank's share is padded to it

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
        for holders in self.holders.values():
            holders.assign()
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

    @property
    def matrices(self) -> int:
        """Muon matrices of this rank's chunks: the NS calls one step makes over the ranks holding them."""
        return sum(len(h.shapes) for h in self.holders.values())

    def step_bytes(self) -> int:
        """Bytes this rank sends in Muon's gathers per step, by the ledger's ring accounting (an all-gather sends
        (N-1)/N of its output): the module docstring's formula, in bytes."""
        elements = sum((h.ranks - 1) * h.width for h in self.holders.values())
        for (buf, b), here in zip(self.bucket_list, self.weights):
            if here:
                holders = self.holders[buf.expert]
                elements += (buf.num_shards - 1) * b.shard_numel + (holders.tp - 1) * b.numel
        return 4 * elements

    @torch.no_grad()
    def step(self, views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], grads: list[torch.Tensor],
             coef: float, lr: float, step: int) -> None:
        """One step on every bucket's (master, exp_avg, exp_avg_sq) ``views`` and fp32 grad shards ``grads``,
        clipped by ``coef`` here (``step``: AdamW's bias-correction count)."""
        c = self.cfg
        hyper = muon_hyper(c, lr)
        adam = AdamHyper(lr=c.adam_lr(lr), weight_decay=c.weight_decay, beta1=c.adam_beta1, beta2=c.adam_beta2,
                         eps=c.adam_eps)
        outputs: dict[int, list[torch.Tensor]] = {id(h): [] for h in self.holders.values()}  # NS of what this
        for i, ((master, exp_avg, exp_avg_sq), g) in enumerate(zip(views, grads)):          # rank owns, in order
            if coef < 1.0:
                g.mul_(coef)
            adamw_shard_step(master, g, exp_avg, exp_avg_sq, self.adam_runs[i], adam, step)
            if not self.weights[i]:  # the same buckets on every holder: no Muon weight, no gather
                continue
            direction = torch.zeros_like(g)
            for lo, hi in self.muon_runs[i]:
                direction[lo:hi] = momentum_direction_(g[lo:hi], exp_avg[lo:hi], hyper)
            for weight, full in zip(self.weights[i], self._assemble(i, direction)):
                holders = weight.holders
                for k, m in enumerate(weight.matrices, start=weight.first):
                    if holders.owners[k] == holders.rank:
                        outputs[id(holders)].append(newton_schulz(take_matrix(full, m), hyper.ns_steps,
                                                                  hyper.ns_coefficients, hyper.eps,
                                                                  hyper.ns_dtype).float())
                        self.ns_calls += 1
        device = views[0][0].device if views else torch.device("cpu")
        updates = {id(h): self._share(h, outputs[id(h)], device) for h in self.holders.values()}  # dense first
        decay = 1 - hyper.lr * hyper.weight_decay
        for i, (master, _, _) in enumerate(views):
            for lo, hi in self.muon_runs[i]:
                master[lo:hi].mul_(decay)
            for weight, segments in self.pieces[i]:
                local = self._local_updates(weight, updates[id(weight.holders)], hyper.lr) if segments else ()
                for alpha, update in local:
                    for s in segments:
                        master[s.lo:s.hi].add_(update[s.param_lo:s.param_lo + s.hi - s.lo], alpha=alpha)

    def _assemble(self, i: int, direction: torch.Tensor) -> list[torch.Tensor]:
        """The full (TP-joined) direction of each Muon weight of bucket ``i`` from this rank's shard of it."""
        buf, b = self.bucket_list[i]
        holders = self.holders[buf.expert]
        bucket = direction
        if buf.num_shards > 1:
            bucket = direction.new_empty(b.numel)
            C.all_gather_into_tensor(bucket, direction, self.reductions[i].group, phase=PHASE)
        gathered = bucket.new_empty(holders.tp * b.numel)
        C.all_gather_into_tensor(gathered, bucket, holders.tp_group, phase=PHASE)  # tp 1: a copy
        per_rank = gathered.view(holders.tp, b.numel)
        out = []
        for weight in self.weights[i]:
            n, shape = weight.param.numel(), weight.param.shape
            pieces = [per_rank[r, weight.offset:weight.offset + n].view(shape) for r in range(holders.tp)]
            dim = spec_of(weight.param).split_dim
            out.append(pieces[holders.tp_rank].clone() if dim is None else torch.cat(pieces, dim=dim))
        return out

    def _share(self, holders: Holders, outputs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Every matrix of ``holders`` as NS left it, on each of its ranks: each rank's outputs padded to the set's
        ``width``, all-gathered over the TP group and then over the reduction group (rank order: the set's)."""
        if not holders.shapes:
            return []
        mine = torch.zeros(holders.width, dtype=torch.float32, device=device)
        if outputs:
            flat = torch.cat([t.reshape(-1) for t in outputs])
            mine[:flat.numel()] = flat
        over_tp = mine.new_empty(holders.tp * holders.width)
        C.all_gather_into_tensor(over_tp, mine, holders.tp_group, phase=PHASE)
        everyone = mine.new_empty(holders.ranks * holders.width)
        C.all_gather_into_tensor(everyone, over_tp, holders.reduction.group, phase=PHASE)
        updates: list[torch.Tensor] = [torch.empty(0)] * len(holders.shapes)
        for rank, owned in enumerate(holders.owned_by):
            at = rank * holders.width
            for k in owned:
                rows, cols = holders.shapes[k]
                updates[k] = everyone[at:at + rows * cols].view(rows, cols)
                at += rows * cols
        return updates

    def _local_updates(self, weight: MuonWeight, updates: list[torch.Tensor],
                       lr: float) -> list[tuple[float, torch.Tensor]]:
        """(-adjusted lr, the NS outputs of the weight's matrices taking it placed in the full weight, zero
        elsewhere, cut to this rank's TP slice, flat) per distinct adjusted lr: ``w.add_(update, alpha)`` is then
        the one rounding ``muon_step_`` makes, and adds an exact zero to the other matrices' elements."""
        by_alpha: dict[float, torch.Tensor] = {}
        for k, m in enumerate(weight.matrices, start=weight.first):
            alpha = -adjusted_lr(lr, updates[k].shape, self.cfg.muon_lr_adjust)
            if alpha not in by_alpha:
                by_alpha[alpha] = torch.zeros(weight.full_shape, dtype=torch.float32, device=updates[k].device)
            add_to_matrix_(by_alpha[alpha], m, updates[k])
        dim = spec_of(weight.param).split_dim
        out = []
        for alpha, full in by_alpha.items():
            if dim is not None:
                local = weight.param.shape[dim]
                full = full.narrow(dim, weight.holders.tp_rank * local, local)
            out.append((alpha, full.reshape(-1)))
        return out
