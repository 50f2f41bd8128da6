"""ZeRO 3 (``--zero 3``): parameters live as 1/dp shards and are gathered one unit at a time.

A unit is a run of ``layers_per_unit`` transformer blocks of a model chunk; the
chunk's parameters outside blocks (embeddings, final norm, head) form its
*root* unit. A unit's parameters fill whole buckets (``plan_buckets`` closes a
bucket at a unit boundary), and each bucket's full-size parameter tensor has a
storage of its own that holds bytes only while its unit is gathered: freeing
resizes the storage to 0 bytes, gathering resizes it back and all-gathers the
shards into it. The parameters stay views of that storage throughout, so what
autograd saved in forward (a weight, its transpose) reads the regathered values
in backward without holding the memory in between - FSDP's approach.

Per unit and micro-batch (hooks, so the model code does not change):

    forward pre-hook    issue the unit's all-gather unless prefetched, issue the next
                        ``prefetch`` units' all-gathers, then wait for the unit's
    forward post-hook   free - unless the unit is kept until its backward
                        (``reshard_after_forward=False``, and always the root unit,
                        whose head runs last in forward and first in backward); a
                        hook on the unit's output marks where its backward starts
    pre-backward        gather again (issue, prefetch the previous ``prefetch`` units, wait)
    post-backward       (the unit's last parameter gradient has accumulated) free it;
                        the gradient engine reduce-scatters its buckets as they complete

Without grad (evaluation) every unit is freed after its forward. Recompute needs
nothing more: the pre-backward gather runs before autograd re-runs a block. A kept
unit counts the micro-batches whose forward ran and whose backward has not, and is
freed when none is left, so under pipelining it stays gathered for as long as any
micro-batch of the step is in flight on this stage.

A unit keeps where it stands as one value (``UnitState``: FREED, GATHERING, GATHERED, as
FSDP2's ``ShardedState``) and owns its "all my gradients arrived" event (``Unit.grad_arrived``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from ..model.chunk import blocks_of
from ..model.transformer import TransformerBlock
from ..parallel import collectives as C
from ..run_plan import UnitGathering
from .buffers import ParamGradBuffer
from .layout import Bucket
from .reduction import ReductionGroup


@dataclass
class UnitSpec:
    """Which parameters form a unit and which modules' forward enters and leaves it."""

    entry: nn.Module
    exit: nn.Module
    params: list[nn.Parameter]
    root: bool  # the chunk's parameters outside blocks: kept gathered from forward to backward
    blocks: list[TransformerBlock] = field(default_factory=list)  # the blocks it gathers (none for the root)


def plan_units(module: nn.Module, layers_per_unit: int) -> list[UnitSpec]:
    """``module``'s units in forward order.

    The root unit (everything outside the blocks; entered and left through ``module`` itself)
    comes first, when the chunk has such parameters; then every ``layers_per_unit`` consecutive
    blocks (``blocks_of``) form one unit, entered through its first block and left through its last.
    """
    trainable = [p for p in module.parameters() if p.requires_grad]
    blocks = blocks_of(module)
    in_blocks = {p for block in blocks for p in block.parameters()}
    units = [UnitSpec(module, module, [p for p in trainable if p not in in_blocks], root=True)]
    for i in range(0, len(blocks), layers_per_unit):
        group = blocks[i: i + layers_per_unit]
        units.append(UnitSpec(group[0], group[-1], [p for b in group for p in b.parameters() if p.requires_grad],
                              root=False, blocks=group))
    return [u for u in units if u.params]


class UnitState(enum.Enum):
    """Where a unit's parameters stand."""

    FREED = "freed"  # only the shards hold bytes
    GATHERING = "gathering"  # fetches / all-gathers issued, not yet waited for
    GATHERED = "gathered"  # the full parameters are readable


@dataclass
class Unit:
    index: int  # forward position within its chunk
    params: list[nn.Parameter]
    root: bool
    buckets: list[tuple[ParamGradBuffer, Bucket]]
    keep_until_backward: bool
    state: UnitState = UnitState.FREED
    works: list = field(default_factory=list)  # all-gathers issued, not yet waited for
    fetches: list = field(default_factory=list)  # --offload-params: (buf, bucket, shard fetch) not yet gathered
    sources: list = field(default_factory=list)  # fetched shards the issued all-gathers read from
    pending_backward: int = 0  # micro-batches past this unit's forward, not yet past its backward
    grads_arrived: int = 0  # parameter gradients accumulated in the current backward

    def grad_arrived(self) -> bool:
        """Count one parameter gradient; True when it completes this unit's backward for the micro-batch."""
        self.grads_arrived += 1
        if self.grads_arrived < len(self.params):
            return False
        self.grads_arrived = 0
        self.pending_backward = max(0, self.pending_backward - 1)
        return True

    def reset(self) -> None:
        """End of a step: no micro-batch is pending (one whose gradients never arrived included)."""
        self.pending_backward = self.grads_arrived = 0


class ParameterUnits:
    """The gathered/freed state of every unit of this rank's chunks, driven by module and grad hooks."""

    def __init__(self, modules: list[nn.Module], chunk_buffers: list[list[ParamGradBuffer]],
                 units: list[list[UnitSpec]], groups: dict[bool, ReductionGroup],
                 gathering: UnitGathering) -> None:
        """``chunk_buffers``: each chunk's buffers (dense, expert weights); ``groups``: the group each kind of
        buffer is sharded over, keyed by ``ParamGradBuffer.expert`` (a unit gathers over both)."""
        self.groups, self.gathering = {kind: g.group for kind, g in groups.items()}, gathering
        self.chunks: list[list[Unit]] = []
        for bufs, chunk_units in zip(chunk_buffers, units):
            bucket_of = {p: (buf, b) for buf in bufs for b in buf.buckets for p in b.params}
            chunk: list[Unit] = []
            for i, spec in enumerate(chunk_units):
                buckets = {id(bucket_of[p][1]): bucket_of[p] for p in spec.params}
                unit = Unit(index=i, params=spec.params, buckets=list(buckets.values()),
                            root=spec.root, keep_until_backward=spec.root or not gathering.reshard_after_forward)
                chunk.append(unit)
                for block in spec.blocks:  # what ``print(model)`` shows (``TransformerBlock.extra_repr``)
                    block.zero3_unit = i
                spec.entry.register_forward_pre_hook(self._pre_forward_hook(chunk, unit))
                spec.exit.register_forward_hook(self._post_forward_hook(chunk, unit))
                for p in spec.params:
                    p.register_post_accumulate_grad_hook(self._grad_hook(unit))
            self.chunks.append(chunk)

    @property
    def units(self) -> list[Unit]:
        return [u for chunk in self.chunks for u in chunk]

    # -- gather / free ---------------------------------------------------------------------------
    def gather(self, unit: Unit, phase: str, wait: bool = True) -> None:
        """Issue ``unit``'s all-gathers unless it is gathered (or gathering); with ``wait``, complete them.

        ``phase`` ("forward", "backward", "checkpoint") is what the ledger counts them under.
        """
        if unit.state == UnitState.FREED:
            unit.state = UnitState.GATHERING
            deferred = False
            for buf, b in unit.buckets:  # the shard comes to the device (disk: a read overlapping compute)
                unit.fetches.append((buf, b, buf.fetch_param_shard(b)))
                deferred = deferred or buf.fetch_deferred
            if not deferred:
                self._gather_fetched(unit, phase)
        if wait:
            self._gather_fetched(unit, phase)
            for work in unit.works:
                work.wait()
            unit.works.clear()
            unit.sources.clear()
            unit.state = UnitState.GATHERED

    def _gather_fetched(self, unit: Unit, phase: str) -> None:
        """Issue the all-gathers of ``unit``'s fetched shards, each once its fetch has completed."""
        for buf, b, fetch in unit.fetches:
            shard = fetch.result()
            unit.sources.append(shard)
            unit.works.append(C.all_gather_into_tensor(buf.materialize_params(b), shard, self.groups[buf.expert],
                                                       async_op=True, phase=phase))
        unit.fetches.clear()

    def free(self, unit: Unit) -> None:
        if unit.state != UnitState.FREED:
            for _, _, fetch in unit.fetches:  # prefetched, never used: the read completes, no all-gather
                fetch.result()
            unit.fetches.clear()
            for work in unit.works:  # never free storage an all-gather is still writing
                work.wait()
            unit.works.clear()
            unit.sources.clear()
            for buf, b in unit.buckets:
                buf.free_params(b)
            unit.state = UnitState.FREED

    def gather_all(self) -> None:
        """Every unit gathered (checkpoint save, reading weights outside a step); ``free_all`` undoes it."""
        for unit in self.units:
            self.gather(unit, "checkpoint", wait=False)
        for unit in self.units:
            self.gather(unit, "checkpoint")

    def one_unit_at_a_time(self) -> Iterator[list[nn.Parameter]]:
        """Each unit's parameters, gathered while the caller holds them (the next unit's gather overlapping);
        what checkpoint save copies to the host, so a save never holds more than two units."""
        units = self.units
        for i, unit in enumerate(units):
            self.gather(unit, "checkpoint")
            if i + 1 < len(units):
                self.gather(units[i + 1], "checkpoint", wait=False)
            yield unit.params
            self.free(unit)

    def free_all(self) -> None:
        """End of a step: nothing stays gathered (a unit whose gradients never arrived included)."""
        for unit in self.units:
            unit.reset()
            self.free(unit)

    def _prefetch(self, chunk: list[Unit], indices: range, phase: str) -> None:
        for i in indices:
            if 0 <= i < len(chunk):
                self.gather(chunk[i], phase, wait=False)

    # -- hooks -----------------------------------------------------------------------------------
    def _pre_forward_hook(self, chunk: list[Unit], unit: Unit):
        def hook(module: nn.Module, args: tuple) -> None:
            # issue this unit's gather (if not prefetched) and the next ones' before waiting, so the
            # first units of a step (the root, then block 1) travel together instead of one after another
            self.gather(unit, "forward", wait=False)
            self._prefetch(chunk, range(unit.index + 1, unit.index + 1 + self.gathering.prefetch), "forward")
            self.gather(unit, "forward")

        return hook

    def _post_forward_hook(self, chunk: list[Unit], unit: Unit):
        def hook(module: nn.Module, args: tuple, out):
            if not (torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad):
                if unit.pending_backward == 0:  # no backward follows (evaluation)
                    self.free(unit)
                return None
            unit.pending_backward += 1
            out.register_hook(self._pre_backward_hook(chunk, unit))
            if not unit.keep_until_backward:
                self.free(unit)
            return None

        return hook

    def _pre_backward_hook(self, chunk: list[Unit], unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            self.gather(unit, "backward", wait=False)  # as in forward: issue, prefetch, then wait
            # backward runs the units in reverse forward order; the root's head runs first, then the last block
            start = len(chunk) - 1 if unit.root else unit.index - 1
            self._prefetch(chunk, range(start, start - self.gathering.prefetch, -1), "backward")
            self.gather(unit, "backward")

        return hook

    def _grad_hook(self, unit: Unit):
        def hook(p: nn.Parameter) -> None:
            if unit.grad_arrived() and (not unit.keep_until_backward or unit.pending_backward == 0):
                self.free(unit)

        return hook
