"""Token dispatch and combine: this rank's routed tokens to the ranks holding their experts, and back.

Legend: T tokens on this rank, k choices per token, E experts, L = E / ep local experts, H hidden,
A assignments that travel. An assignment is one (token, choice) pair; its "slot" is t * k + j in
the flattened [T, k] routing.

- ``AllToAllDispatcher`` (default): counts per (source rank, expert) are exchanged first (the rows
  to send are gathered meanwhile), then the token rows with uneven splits (a rank's rows for its own
  experts stay home); a receiver sorts them by local expert, runs its experts, unsorts and sends the
  outputs back. Routing weights never travel: the weighting and the sum over the k
  choices happen where the token lives.
- ``AllGatherDispatcher``: every rank of the ep group gathers all its tokens (and weights), runs its
  experts on those routed to them, weights them and reduce-scatters the sums home.

With a capacity (``Capacity``), each expert takes at most ceil(cf * T * k / E) assignments of each
rank's tokens (Megatron's rule), chosen by routing weight or by position; the dropped ones
contribute 0. Padding fills every expert to exactly its capacity with zero rows of weight 0, so every
exchange has a fixed size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from ..parallel import collectives as C
from ..tensor_parallel.comm import reduce_scatter_to_sequence_parallel_region
from .balance import count_slots
from .comm import all_gather_rows, all_to_all_rows_overlapped
from .context import ExpertContext
from .experts import GroupedExperts, expert_ids


@dataclass(frozen=True)
class Capacity:
    """Token dropping: ``factor`` x an even share per expert; ``policy`` says whom to drop; ``pad`` fills up."""

    factor: float
    policy: Literal["probs", "position"] = "probs"
    pad: bool = False

    def per_expert(self, tokens: int, topk: int, num_experts: int) -> int:
        return math.ceil(tokens * topk / num_experts * self.factor)


def kept_slots(experts_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int,
               capacity: Capacity | None) -> torch.Tensor:
    """The slots that travel, sorted by expert (then by drop priority): [A] int64."""
    flat_e = experts_TK.reshape(-1)
    if capacity is None:
        return torch.argsort(flat_e, stable=True)
    # priority order first (highest weight, or earliest token), then a stable sort by expert keeps it per expert
    if capacity.policy == "probs":
        priority = torch.argsort(probs_TK.detach().reshape(-1), descending=True, stable=True)
    else:
        priority = torch.arange(flat_e.numel(), device=flat_e.device)
    order = priority[torch.argsort(flat_e[priority], stable=True)]
    counts = torch.bincount(flat_e, minlength=num_experts)
    rank_in_expert = torch.arange(order.numel(), device=order.device) - (counts.cumsum(0) - counts)[flat_e[order]]
    cap = capacity.per_expert(experts_TK.shape[0], experts_TK.shape[1], num_experts)
    return order[rank_in_expert < cap]


class Plan(NamedTuple):
    """What travels: ``token[a]`` (T = a zero row of padding), ``slot[a]`` (T * k = a weight of 0), sorted by
    expert, ``per_expert[e]`` of them for expert e."""

    token: torch.Tensor
    slot: torch.Tensor
    per_expert: torch.Tensor


def make_plan(experts_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int,
              capacity: Capacity | None) -> Plan:
    """The assignments to send, padded to capacity where asked."""
    tokens, topk = experts_TK.shape
    slot = kept_slots(experts_TK, probs_TK, num_experts, capacity)
    expert = experts_TK.reshape(-1)[slot]
    per_expert = count_slots(expert, num_experts)  # no host read: the ep 1 path never syncs
    if capacity is None or not capacity.pad:
        return Plan(slot // topk, slot, per_expert)
    cap = capacity.per_expert(tokens, topk, num_experts)
    rank_in_expert = torch.arange(slot.numel(), device=slot.device) - (per_expert.cumsum(0) - per_expert)[expert]
    where = expert * cap + rank_in_expert  # kept assignments first in each expert's block, padding after
    padded_slot = torch.full((num_experts * cap,), tokens * topk, dtype=slot.dtype, device=slot.device)
    padded_slot[where] = slot
    return Plan(padded_slot // topk, padded_slot, torch.full_like(per_expert, cap))


def combine_weighted(out_AH: torch.Tensor, plan: Plan, probs_TK: torch.Tensor) -> torch.Tensor:
    """sum over a token's kept choices of weight x expert output: [T, H] in the activations' dtype."""
    probs_pad = torch.cat([probs_TK.reshape(-1), probs_TK.new_zeros(1)])  # slot T * k: padding weighs 0
    weighted = out_AH * probs_pad[plan.slot].unsqueeze(-1)  # promoted: fp32 weights, bf16 rows add in fp32
    tokens = probs_TK.shape[0]
    y = weighted.new_zeros((tokens + 1, out_AH.shape[1])).index_add(0, plan.token, weighted)  # row T: padding
    return y[:tokens].to(out_AH.dtype)


class _SplitBlock(torch.autograd.Function):
    """Forward: rows[start:stop] and the rest (a view when the block is at either end) / backward: the two
    gradients put back in place with one copy (slicing twice would zero-fill and add two full-size ones)."""

    @staticmethod
    def forward(ctx, rows, start, stop):
        ctx.start = start
        rest = rows[stop:] if start == 0 else rows[:start] if stop == rows.shape[0] else \
            torch.cat([rows[:start], rows[stop:]])
        return rows[start:stop], rest

    @staticmethod
    def backward(ctx, grad_block, grad_rest):
        return torch.cat([grad_rest[:ctx.start], grad_block, grad_rest[ctx.start:]]), None, None


def _zero_at(splits: list[int], index: int) -> list[int]:
    return [0 if i == index else n for i, n in enumerate(splits)]


def _own_block_in_two(plan: Plan, start: int, own: list[int], first: list[int]) -> Plan:
    """``plan`` with this rank's own block (``own[l]`` rows of local expert l from ``start``) reordered: the
    first ``first[l]`` rows of each expert, then the rest, so each part is one slice sorted by expert."""
    device, rows = plan.token.device, sum(own)
    own_t, first_t = torch.tensor(own, device=device), torch.tensor(first, device=device)
    expert = expert_ids(own_t, rows)
    rank_in_expert = torch.arange(rows, device=device) - (own_t.cumsum(0) - own_t)[expert]
    second = (rank_in_expert >= first_t[expert]).to(torch.int8)
    order = torch.arange(plan.token.numel(), device=device)
    order[start:start + rows] = start + torch.argsort(second, stable=True)
    return Plan(plan.token[order], plan.slot[order], plan.per_expert)


class AllToAllDispatcher:
    """Dropless (or capacity-bound) all-to-all over the ep group; see the module docstring.

    The rows a rank routes to its own experts never enter the all-to-all: half of each expert's run while
    the other rows travel out, the other half while their outputs travel home (and, in backward, each half
    while the matching gradients travel back), so both trips hide behind that compute.
    """

    def __init__(self, num_experts: int, ctx: ExpertContext, capacity: Capacity | None) -> None:
        self.num_experts, self.ctx, self.capacity = num_experts, ctx, capacity

    def __call__(self, x_TH: torch.Tensor, probs_TK: torch.Tensor, experts_TK: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        ep, group, me = self.ctx.ep, self.ctx.ep_group, self.ctx.ep_rank
        plan = make_plan(experts_TK, probs_TK, self.num_experts, self.capacity)
        padded = self.capacity is not None and self.capacity.pad
        x_src = torch.cat([x_TH, x_TH.new_zeros((1, x_TH.shape[1]))]) if padded else x_TH  # row T: padding
        if ep == 1:
            return combine_weighted(experts(x_src[plan.token], plan.per_expert), plan, probs_TK)
        received = torch.empty_like(plan.per_expert)  # [ep * L]: rows for each local expert from each source
        exchange = C.all_to_all_single(received, plan.per_expert, group, async_op=True)
        sent_EL = plan.per_expert.view(ep, -1).tolist()  # the rows gather while the counts travel
        send_splits, own = [sum(row) for row in sent_EL], sent_EL[me]
        start, first = sum(send_splits[:me]), [n // 2 for n in own]  # the halves hiding the two trips
        plan = _own_block_in_two(plan, start, own, first)
        send = x_src[plan.token]  # by destination rank, then by its local expert (this rank's block: in two)
        exchange.wait()
        received_EL = received.view(ep, -1)
        away, home = _zero_at(send_splits, me), _zero_at(received_EL.sum(1).tolist(), me)
        mine, others = _SplitBlock.apply(send, start, start + send_splits[me])
        mine_first, mine_second = mine.split([sum(first), send_splits[me] - sum(first)])
        rows, out_first = all_to_all_rows_overlapped(  # [other source][local expert]
            others, group, home, away, lambda: experts(mine_first, first))
        out = self._other_sources(rows, torch.cat([received_EL[:me], received_EL[me + 1:]]), experts)
        back, out_second = all_to_all_rows_overlapped(  # in the order sent, less this rank's own block
            out, group, away, home, lambda: experts(mine_second, [n - f for n, f in zip(own, first)]))
        return combine_weighted(torch.cat([back[:start], out_first, out_second, back[start:]]), plan, probs_TK)

    @staticmethod
    def _other_sources(rows: torch.Tensor, counts_SL: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """The experts on rows from the other ranks, blocked [source][local expert]: sorted by local expert
        for one grouped call (one source is sorted already), results in the order received."""
        if counts_SL.shape[0] == 1:
            return experts(rows, counts_SL[0].tolist())
        order = torch.argsort(torch.cat([expert_ids(row) for row in counts_SL]), stable=True)
        return experts(rows[order], counts_SL.sum(0).tolist())[torch.argsort(order)]


class AllGatherDispatcher:
    """Every ep rank sees the group's tokens; outputs are weighted there and reduce-scattered home."""

    def __init__(self, num_experts: int, ctx: ExpertContext, capacity: Capacity | None) -> None:
        self.num_experts, self.ctx, self.capacity = num_experts, ctx, capacity

    def __call__(self, x_TH: torch.Tensor, probs_TK: torch.Tensor, experts_TK: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        group, local = self.ctx.ep_group, experts.num_local
        dropped = torch.ones(experts_TK.numel(), dtype=torch.bool, device=experts_TK.device)
        dropped[kept_slots(experts_TK, probs_TK, self.num_experts, self.capacity)] = False
        chosen_TK = experts_TK.masked_fill(dropped.view_as(experts_TK), -1)  # -1: no expert anywhere
        every_TK = torch.empty((self.ctx.ep * chosen_TK.shape[0], chosen_TK.shape[1]), dtype=chosen_TK.dtype,
                               device=chosen_TK.device)
        C.all_gather_into_tensor(every_TK, chosen_TK, group)
        x_all, probs_all = all_gather_rows(x_TH, group), all_gather_rows(probs_TK, group)
        first = self.ctx.ep_rank * local
        mine = (every_TK >= first) & (every_TK < first + local)
        slot = torch.nonzero(mine.reshape(-1)).squeeze(1)
        slot = slot[torch.argsort(every_TK.reshape(-1)[slot], stable=True)]  # sorted by local expert
        counts = torch.bincount(every_TK.reshape(-1)[slot] - first, minlength=local)
        topk = experts_TK.shape[1]
        out = experts(x_all[slot // topk], counts.tolist())
        plan = Plan(slot // topk, slot, counts)
        y_all = combine_weighted(out, plan, probs_all)
        return reduce_scatter_to_sequence_parallel_region(y_all, group)
