"""The reduction group and the per-stage reduction policy, both decided once when the engine is built.

``ReductionGroup`` is the group gradients are summed over and shards are cut across, and what the sum
is divided by to be the serial mean, decided in one place: dense parameters use the data-parallel group
times the context-parallel group (``ReductionGroup.of``), mixture-of-experts expert weights the
expert-data-parallel group (``ReductionGroup.experts_of``), both divided by dp x cp.

A ``Reduction`` is what a ``ZeroStage`` does with a completed bucket's gradient (``launch``) and when
it finishes (``retire``); the engine calls the policy it picked at construction instead of testing
the stage in its hooks:

    ZeRO 0  AllReduce                 all-reduce the bucket (pre-divided by the group's divisor)
    ZeRO 1  ReduceScatterInPlace      reduce-scatter into this rank's shard, a view of the bucket
    ZeRO 2  ReduceScatterRelease      reduce-scatter into the persistent grad shard, then free the
                                      full-size bucket gradient (a bounded number in flight)
    ZeRO 2  ReduceScatterEveryMicroBatch  (--reduce-every-micro-batch) every micro-batch: reduce-scatter
                                      in place, add this rank's slice to the persistent shard, then free
                                      the bucket gradient
    ZeRO 3  ReduceScatterIntoShard    every micro-batch: reduce-scatter into a temporary shard that
                                      is added to the persistent one, then free the bucket gradient

The policy is looked up once by (stage, ``GradReduction``), the run plan's choice of when gradients leave
the buckets (``POLICIES``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel import collectives as C
from ..parallel.state import ParallelState
from ..run_plan import GradReduction, ZeroStage


@dataclass(frozen=True)
class ReductionGroup:
    """The ranks that sum gradients and split shards (``group`` None: this rank alone), and ``divisor``: what
    each rank's gradient is divided by before the sum, so that the sum is the serial mean."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    divisor: int

    @classmethod
    def of(cls, pstate: ParallelState) -> "ReductionGroup":
        """Dense parameters: dp x cp (CP ranks hold the same weights; at cp 1 the DP group), averaged over it."""
        return cls(pstate.dp_cp_group, pstate.dp_cp, pstate.dp_cp_rank, divisor=pstate.dp_cp)

    @classmethod
    def experts_of(cls, pstate: ParallelState) -> "ReductionGroup":
        """Expert weights: summed over the expert-data-parallel group (edp ranks), divided by dp x cp.

        Each of the dp x cp token shards is scaled by dp x cp / B in its local loss (B: the global batch's
        tokens), so a dense rank's gradient is dp x cp times its share of the serial mean and averaging over
        dp x cp gives the serial gradient. An expert replica (one edp rank) instead computes its gradient
        from the tokens routed to it from every rank of its expert-parallel group (etp x ep ranks, each with
        distinct tokens: tp ranks hold distinct sequence chunks under sequence parallelism): the edp replicas
        together see each of the B tokens once, each with the same weight dp x cp / B. Hence

            serial = (1 / B) sum_all tokens = (1 / (dp x cp)) sum_{edp replicas} local gradient,

        i.e. the net factor is 1 / (dp x cp) on a sum over edp ranks (an edp average times edp / (dp x cp)),
        and it applies even when edp is 1 (no collective, the division alone).
        """
        return cls(pstate.edp_group, pstate.edp, pstate.edp_rank, divisor=pstate.dp_cp)


class AllReduce:
    """ZeRO 0: every rank ends with the whole averaged bucket."""

    every_micro_batch = False  # reduce only on the step's last micro-batch (no_sync before)
    bounded = False  # full-size gradients persist anyway: no limit on reductions in flight
    gathers_after_step = False  # every rank updated every parameter

    def __init__(self, group: ReductionGroup) -> None:
        self.group = group

    def launch(self, shard: torch.Tensor, grad_b: torch.Tensor) -> tuple[object, torch.Tensor | None]:
        """Start the reduction of bucket gradient ``grad_b`` [numel]; returns (work, partial shard)."""
        if self.group.divisor > 1:
            grad_b.div_(self.group.divisor)
        if self.group.group is None:
            self.alone(shard, grad_b)
            return None, None
        return self.issue(shard, grad_b)

    def alone(self, shard: torch.Tensor, grad_b: torch.Tensor) -> None:
        """A group of one: the bucket is its own average (the shard is a view of it)."""

    def issue(self, shard: torch.Tensor, grad_b: torch.Tensor) -> tuple[object, torch.Tensor | None]:
        return C.all_reduce(grad_b, self.group.group, async_op=True), None

    @staticmethod
    def retire(shard: torch.Tensor, partial: torch.Tensor | None) -> None:
        """The reduction has completed: fold in what it wrote beside the shard (ZeRO 3)."""


class ReduceScatterInPlace(AllReduce):
    """ZeRO 1: this rank's shard, a view of the bucket gradient, receives the reduced slice."""

    gathers_after_step = True  # each rank updated its shard: all-gather the parameters

    def issue(self, shard: torch.Tensor, grad_b: torch.Tensor) -> tuple[object, torch.Tensor | None]:
        return C.reduce_scatter_tensor(shard, grad_b, self.group.group, async_op=True), None


class ReduceScatterRelease(ReduceScatterInPlace):
    """ZeRO 2: the shard is persistent storage of its own; the bucket gradient is freed on retiring."""

    bounded = True

    def alone(self, shard: torch.Tensor, grad_b: torch.Tensor) -> None:
        shard.copy_(grad_b)


class ReduceScatterEveryMicroBatch(ReduceScatterRelease):
    """ZeRO 2 with --reduce-every-micro-batch: each micro-batch's bucket is reduce-scattered in place (this
    rank's slice of the bucket receives its reduced share, as ZeRO 1's) and that slice is added to the
    persistent shard on retiring; the bucket is then freed, so no full-size gradient outlives a backward."""

    every_micro_batch = True

    def alone(self, shard: torch.Tensor, grad_b: torch.Tensor) -> None:
        shard.add_(grad_b)

    def issue(self, shard: torch.Tensor, grad_b: torch.Tensor) -> tuple[object, torch.Tensor | None]:
        n = shard.numel()
        mine = grad_b[self.group.rank * n: (self.group.rank + 1) * n]
        return C.reduce_scatter_tensor(mine, grad_b, self.group.group, async_op=True), mine

    @staticmethod
    def retire(shard: torch.Tensor, partial: torch.Tensor | None) -> None:
        if partial is not None:
            shard.add_(partial)


class ReduceScatterIntoShard(ReduceScatterEveryMicroBatch):
    """ZeRO 3: each micro-batch's share is reduce-scattered apart and added to the shard on retiring."""

    gathers_after_step = False  # the next forward gathers

    def issue(self, shard: torch.Tensor, grad_b: torch.Tensor) -> tuple[object, torch.Tensor | None]:
        partial = torch.empty_like(shard)
        return C.reduce_scatter_tensor(partial, grad_b, self.group.group, async_op=True), partial


ONCE, EVERY = GradReduction.ONCE_PER_STEP, GradReduction.EVERY_MICRO_BATCH
POLICIES: dict[tuple[ZeroStage, GradReduction], type[AllReduce]] = {
    (ZeroStage.NONE, ONCE): AllReduce, (ZeroStage.OPTIMIZER_STATE, ONCE): ReduceScatterInPlace,
    (ZeroStage.GRADIENTS, ONCE): ReduceScatterRelease, (ZeroStage.GRADIENTS, EVERY): ReduceScatterEveryMicroBatch,
    (ZeroStage.PARAMETERS, EVERY): ReduceScatterIntoShard}


def reduction_for(stage: ZeroStage, group: ReductionGroup, when: GradReduction) -> AllReduce:
    """The one policy a run's engine uses for every bucket of every step."""
    assert (stage, when) in POLICIES, f"no reduction policy reduces gradients {when.value} at ZeRO {int(stage)}"
    return POLICIES[stage, when](group)
