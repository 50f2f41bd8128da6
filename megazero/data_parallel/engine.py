"""The gradient-sync engine: buckets, grad hooks and every data-parallel collective of a step.

Per step, for every bucket of every model chunk (``buffers.py``):

    backward hooks      p.grad -> p.main_grad (accumulate), p.grad = None
    bucket complete     (outside ``no_sync``; reducing every micro-batch: always) launch its
                        reduction over its buffer's reduction group (``ReductionGroup``: dp x cp;
                        a buffer of expert weights: the expert-data-parallel group),
                        async, by the policy picked once at construction from the stage and
                        the plan's ``GradReduction`` (``reduction.py``):
                          ZeRO 0: all-reduce the bucket (pre-divided by dp x cp)
                          ZeRO 1: reduce-scatter it in place into this rank's shard
                          ZeRO 2: reduce-scatter it into the persistent grad shard, then
                                  free the full-size bucket gradient
                          ZeRO 2, --reduce-every-micro-batch: reduce-scatter each micro-
                                  batch's bucket in place, add this rank's slice to the
                                  persistent shard, then free the bucket
                          ZeRO 3: reduce-scatter each micro-batch's bucket into a temporary
                                  shard added to the persistent one, then free the bucket
    finish()            launch what the hooks did not, wait for all; sum replicated grads
                        (SP params over TP, tied embedding over the embedding group) on the
                        reduced shards
    gather_params()     after the step updated the shards: all-gather the full buckets
                        (async when ``overlap_param_gather``; each block waits for its own
                        buckets in a forward pre-hook)

Replicated-gradient sums commute with the DP sum, so doing them on the
reduced shards, after the DP communication, gives the serial result while
keeping every bucket in the overlapped path: TP ranks share one buffer layout
and DP rank, so they own identical shards; the tied embedding has a bucket
of its own, so both pipeline stages shard it identically.

ZeRO 2 with several micro-batches (``no_sync`` active for all but the last
backward) keeps the full-size bucket gradients as a transient accumulation
buffer until the last micro-batch reduce-scatters them: one reduce-scatter
per step, as ZeRO 1, at the price of a full gradient buffer during
accumulation. With one micro-batch only the buckets in flight are full-size.
``--reduce-every-micro-batch`` (DeepSpeed's way) reduce-scatters every micro-batch
as its buckets fill, as ZeRO 3 does: only the buckets in flight are ever full-size,
at m reduce-scatters per step. Every policy that reduces each micro-batch retires
its reductions at the end of each backward (``_drain``), before the next forward.

ZeRO 3 (``ZeroStage.shards_parameters``) adds ``ParameterUnits``
(``zero3.py``): the buffers keep only parameter shards between uses, units
gather and free them around their forward and backward, and every micro-batch's
backward reduce-scatters each bucket as it completes (``no_sync`` does not apply)
into a temporary shard that is added to the persistent grad shard: no full-size
gradient outlives its bucket's reduce-scatter, at m reduce-scatters per step.
``gather_params`` is then a no-op: the next forward gathers.

How offload plugs in (an addition to this engine, not a rewrite): a bucket's
shard (grad shard, and the step's master weights and moments) is given a
placement (``RunPlan.placement``); on CUDA the engine starts each reduced grad
shard's copy to pinned host memory when the bucket retires for the step's last
micro-batch (``_retire``, ``host_transfers.HostTransfers``, built here from the
placement), the step runs where the state lives, and copies the updated parameter shards back before
``gather_params``. The collectives and their order do not change, so on a
CPU-only machine an offloaded run is bitwise the in-memory run (on CUDA the
host's AdamW kernel rounds differently from the device's).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..config import Placement
from ..model.chunk import blocks_of
from ..parallel import collectives as C
from ..parallel.collectives import all_reduce_coalesced
from ..parallel.state import ParallelState
from ..run_plan import GradReduction, StatePlacement, UnitGathering, ZeroStage
from ..tensor_parallel.layers import spec_of
from .buffers import ParamGradBuffer
from .host_transfers import HostTransfers, disk_buffer_width
from .layout import Bucket
from .param_offload import param_shard_factory
from .reduction import ReductionGroup, reduction_for
from .storage import storage_for
from .zero3 import ParameterUnits, plan_units

# ZeRO 2/3: at most this many reduce-scatters in flight; launching another first waits for the oldest,
# so the full-size bucket gradients alive during backward are bounded (in flight + the one filling).
MAX_INFLIGHT_BUCKETS = 2


class InFlight(NamedTuple):
    """One bucket's reduction in flight, until ``GradSyncEngine._retire`` waits for it."""

    buf: ParamGradBuffer
    bucket: Bucket
    work: object  # the collective's handle (None: nothing to wait for)
    partial: torch.Tensor | None  # the slice or partial shard it writes (gradient bytes alive until it retires)
    final: bool  # reduced for the step's last micro-batch


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """How the engine syncs gradients: the ZeRO stage and what the run plan derived for it."""

    stage: ZeroStage = ZeroStage.NONE
    bucket_size: int = 10_000_000  # elements per bucket
    main_grads_dtype: torch.dtype = torch.float32
    overlap_param_gather: bool = False  # ZeRO 1/2: each block waits for its buckets' all-gather
    grad_reduction: GradReduction | None = None  # None: the stage's default (``GradReduction.of``)
    gathering: UnitGathering | None = None  # ZeRO 3: None takes the default units
    placement: StatePlacement = field(default_factory=StatePlacement)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", ZeroStage(self.stage))  # tests may pass the stage's number

    @property
    def units(self) -> UnitGathering | None:
        """ZeRO 3's units (the default ones unless given); None below ZeRO 3."""
        return (self.gathering or UnitGathering()) if self.stage.shards_parameters else None


class GradSyncEngine:
    """Bucketed buffers of ``modules`` and their reduction/gather by ``settings``.

    Each chunk has a buffer of dense parameters, reduced and sharded over dp x cp (``group``), and, when it
    holds mixture-of-experts expert weights (``ParamSpec.expert``), a buffer of those, reduced and sharded
    over the expert-data-parallel group (``groups[True]``, ``ReductionGroup.experts_of``); ``buffers`` lists
    them all. Both the buffers' storage (``storage``: replicated, sharded or offloaded parameters, full or
    sharded gradients; ``storage.storage_for``) and the reduction policy (``reduction.reduction_for``) are
    picked once here from the stage. ``pstate`` gives the device and the replicated-grad groups (TP,
    embedding). Building it hooks the model, in this order: the per-parameter gradient hooks (into main
    grads, buckets launch), ZeRO 3's units (gather/free around each unit; their grad hooks run after the
    buckets'), the gather waits (``overlap_param_gather``). Whatever the engine makes it closes (``close``).
    """

    def __init__(self, modules: list[nn.Module], pstate: ParallelState,
                 settings: EngineSettings = EngineSettings()) -> None:
        self.settings, self.stage = settings, settings.stage
        self.pstate, self.group = pstate, ReductionGroup.of(pstate)
        stage, gathering = self.stage, settings.units
        has_experts = any(spec_of(p).expert for m in modules for p in m.parameters())
        # keyed by ``ParamGradBuffer.expert``; ParallelState asked for the expert grid only when it is used
        self.groups = {False: self.group, **({True: ReductionGroup.experts_of(pstate)} if has_experts else {})}
        when = settings.grad_reduction or GradReduction.of(stage)
        self.reductions = {kind: reduction_for(stage, group, when) for kind, group in self.groups.items()}
        self.reduction = self.reductions[False]  # the policy's flags, the same for every group
        units = [plan_units(m, gathering.layers_per_unit) for m in modules] if gathering else [None] * len(modules)
        where = settings.placement
        self.storage = storage_for(stage, param_shard_factory(where.parameters, where.offload_path, pstate.rank))
        self.buffers, self.chunk_of = self._build_buffers(modules, units, settings.bucket_size,
                                                          settings.main_grads_dtype)
        self._sync = True
        self._drain_queued = False  # reducing every micro-batch: an end-of-backward callback will retire them
        self._inflight: list[InFlight] = []
        self._gathers: dict[tuple[int, int], object] = {}
        self.transfers = _host_transfers(self.buffers, pstate.device, settings.placement)
        self.overlap_param_gather = (settings.overlap_param_gather and self.reduction.gathers_after_step
                                     and any(g.group is not None for g in self.groups.values()))
        for buf in self.buffers:  # first: a unit's grad hook below counts gradients these have accumulated
            for b in buf.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._grad_hook(buf, b))
        self.units = (ParameterUnits(modules, [self.buffers_of_chunk(i) for i in range(len(modules))], units,
                                     self.groups, gathering) if gathering else None)
        if self.overlap_param_gather:
            for i, module in enumerate(modules):
                self._register_gather_waits(i, module)

    def _build_buffers(self, modules: list[nn.Module], units: list, bucket_size: int,
                       main_grads_dtype: torch.dtype) -> tuple[list[ParamGradBuffer], list[int]]:
        """Per model chunk, a buffer of its dense parameters and one of its expert weights (if any), each sharded
        over its reduction group from ZeRO 1 on and stored as the run's ``storage`` says; returns the buffers and
        the chunk of each."""
        sharded = self.stage.shards_optimizer_state
        buffers: list[ParamGradBuffer] = []
        chunk_of: list[int] = []
        try:
            for index, (module, chunk_units) in enumerate(zip(modules, units)):
                params = [p for p in module.parameters() if p.requires_grad]
                dtypes = {p.dtype for p in params}
                assert len(dtypes) == 1, f"a model chunk must have one parameter dtype, got {dtypes}"
                unit_of = None if chunk_units is None else {p: i for i, u in enumerate(chunk_units) for p in u.params}
                for expert, group in self.groups.items():
                    mine = [p for p in params if spec_of(p).expert == expert]
                    if not mine:
                        continue
                    buffers.append(ParamGradBuffer(
                        mine, bucket_size=bucket_size, num_shards=group.size if sharded else 1,
                        shard_rank=group.rank if sharded else 0, param_dtype=next(iter(dtypes)),
                        grad_dtype=main_grads_dtype, storage=self.storage, device=self.pstate.device,
                        unit_of=unit_of, expert=expert))
                    chunk_of.append(index)
        except BaseException:  # the parameter-shard files of the buffers made so far go now
            for buf in buffers:
                buf.close()
            raise
        return buffers, chunk_of

    def buffers_of_chunk(self, index: int) -> list[ParamGradBuffer]:
        """The buffers (dense, then expert weights) of model chunk ``index``."""
        return [buf for buf, chunk in zip(self.buffers, self.chunk_of) if chunk == index]

    @property
    def inflight_partials(self) -> list[torch.Tensor]:
        """The slices or partial shards the reductions in flight write into: gradient bytes alive until they
        retire (what a measurement of a step's gradient memory counts)."""
        return [entry.partial for entry in self._inflight if entry.partial is not None]

    def close(self) -> None:
        """Release what the buffers made (``--offload-params``: the parameter-shard stores)."""
        for buf in self.buffers:
            buf.close()

    # -- a step's gradients -------------------------------------------------------------------
    def zero_grad(self) -> None:
        assert not self._inflight, "zero_grad() while gradient communication is in flight"
        for buf in self.buffers:
            buf.zero_grad()
            for p in buf.params:
                p.grad = None
        if self.transfers is not None:
            self.transfers.reset()  # a skipped step left its copies unread: this step copies afresh

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate: buckets launch no communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish(self) -> None:
        """Complete the step's reduction: every bucket's shard holds the summed, DP-averaged grads."""
        for buf in self.buffers:
            for b in buf.buckets:
                if not b.launched:  # unused params, or no backward at all
                    self._launch(buf, b)
        self._reap(block=True)
        if self.units is not None:
            self.units.free_all()
        self._sync_replicated_shards()
        if self.transfers is not None:
            self.transfers.finish_grads([(buf, b) for buf in self.buffers for b in buf.buckets],
                                        lambda buf, b: buf.grad_shard(b))

    def grad_shards(self) -> list[list[torch.Tensor]]:
        """This rank's reduced-gradient shard [shard_numel] of every bucket, per buffer."""
        return [[buf.grad_shard(b) for b in buf.buckets] for buf in self.buffers]

    def agree_over_dp(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.MAX) -> None:
        """Reduce a step decision (``t``, e.g. an overflow flag) over dp x cp: after a reduction over the
        model-parallel group (tp x pp), every rank of the world has taken part (expert shards included)."""
        if self.group.group is not None:
            C.all_reduce(t, self.group.group, op=op)

    @property
    def sums_norm_over_dp(self) -> bool:
        """Whether ``sum_over_shards`` sums over dp x cp: sharded (ZeRO 1-3), or with an expert grid that is not
        the dense one (ep > 1 or etp != tp), whose expert shards differ across ranks holding the same dense copy.
        A fact of the layout, not of the chunks, so every rank agrees (a pipeline stage without experts too)."""
        return self.stage.shards_optimizer_state or self.pstate.ep > 1 or self.pstate.etp != self.pstate.tp

    def sum_over_shards(self, t: torch.Tensor) -> None:
        """Sum a per-shard quantity (e.g. a squared norm, summed over tp x pp first) over the ranks owning the
        other shards (``sums_norm_over_dp``; ``optimizer.grads.counts_for_norm`` counts each copy once)."""
        if self.sums_norm_over_dp and self.group.group is not None:
            C.all_reduce(t, self.group.group)

    # -- gradient communication -------------------------------------------------------------
    def _grad_hook(self, buf: ParamGradBuffer, b: Bucket) -> Callable[[nn.Parameter], None]:
        def hook(p: nn.Parameter) -> None:
            if p.grad is None:
                return
            assert not b.launched or self.reduction.every_micro_batch, (
                "a gradient reached a bucket already communicated this step; the schedule must run every "
                "backward but a chunk's last one inside optimizer.no_sync()")
            assert not (self.reduction.every_micro_batch and b.ready == 0 and b.grad is not None), (
                "a bucket's reduce-scatter from the last backward is still in flight (_drain retires them)")
            buf.bucket_grad(b)  # ZeRO 2/3: allocate the transient bucket gradient on first use
            p.main_grad.add_(p.grad)
            p.grad = None
            b.ready += 1
            if b.ready == len(b.params):
                b.ready = 0
                if self._sync or self.reduction.every_micro_batch:
                    self._launch(buf, b)
                    if self.reduction.every_micro_batch and not self._drain_queued:
                        self._drain_queued = True
                        torch.autograd.Variable._execution_engine.queue_callback(self._drain)

        return hook

    def _launch(self, buf: ParamGradBuffer, b: Bucket) -> None:
        """Start bucket ``b``'s reduction by the stage's policy over its buffer's group (pre-divided by dp x cp)."""
        grad_b = buf.bucket_grad(b)
        b.launched = True
        work, partial = self.reductions[buf.expert].launch(buf.grad_shard(b), grad_b)
        self._inflight.append(InFlight(buf, b, work, partial, self._sync))
        self._reap(block=False)
        while self.reduction.bounded and len(self._inflight) > MAX_INFLIGHT_BUCKETS:
            self._retire(*self._inflight.pop(0))  # bound the full-size bucket gradients alive at once

    def _drain(self) -> None:
        """Reducing every micro-batch, at the end of each backward: retire every reduction in flight, so no full-size
        bucket gradient lives on into the next forward or the step (FSDP2 does the same)."""
        self._drain_queued = False
        self._reap(block=True)

    def _reap(self, block: bool) -> None:
        """Retire finished reductions; ZeRO 2 frees their full-size bucket gradients."""
        pending = []
        for entry in self._inflight:
            work = entry.work
            if work is None or block or work.is_completed():
                self._retire(*entry)
            else:
                pending.append(entry)
        self._inflight = pending

    def _retire(self, buf: ParamGradBuffer, b: Bucket, work, partial: torch.Tensor | None, final: bool) -> None:
        if work is not None:
            work.wait()
        self.reductions[buf.expert].retire(buf.grad_shard(b), partial)
        buf.release(b)
        if final and self.transfers is not None:  # the shard is complete: start its copy to the host
            self.transfers.grad_ready(b, buf.grad_shard(b))

    def _sync_replicated_shards(self) -> None:
        """Sum SP-replicated grads over TP and tied-embedding grads over the embedding group."""
        tp_views, emb_views = [], []
        for buf in self.buffers:
            for b in buf.buckets:
                shard = buf.grad_shard(b)
                for seg in b.segments:
                    if seg.tp_sync:
                        tp_views.append(shard[seg.lo: seg.hi])
                    if seg.emb_sync:
                        emb_views.append(shard[seg.lo: seg.hi])
        all_reduce_coalesced(tp_views, self.pstate.tp_group)
        all_reduce_coalesced(emb_views, self.pstate.embedding_group)

    # -- parameter all-gather -------------------------------------------------------------
    def gather_params(self) -> None:
        """ZeRO 1/2: every rank updated its shard; gather the full buckets in forward order (ZeRO 3: the
        next forward gathers)."""
        if not self.reduction.gathers_after_step:
            return
        for i, buf in enumerate(self.buffers):
            group = self.groups[buf.expert].group
            if group is None:  # the shard is the whole bucket
                continue
            for b in reversed(buf.buckets):  # the last bucket holds the first layers
                work = C.all_gather_into_tensor(buf.param_bucket(b), buf.param_shard(b), group,
                                                async_op=self.overlap_param_gather)
                if self.overlap_param_gather:
                    self._gathers[(i, b.index)] = work

    def wait_param_gather(self) -> None:
        """Block until every updated parameter has arrived (before reading weights outside forward)."""
        for work in self._gathers.values():
            work.wait()
        self._gathers.clear()

    def _register_gather_waits(self, index: int, module: nn.Module) -> None:
        """Each block (``blocks_of``) waits for its buckets just before its forward; parameters outside
        blocks (embeddings, head, final norm) at the chunk's start."""
        bucket_of = {p: (i, b.index) for i, (buf, chunk) in enumerate(zip(self.buffers, self.chunk_of))
                     if chunk == index for b in buf.buckets for p in b.params}
        covered: set[nn.Parameter] = set()
        for block in blocks_of(module):
            params = [p for p in block.parameters() if p in bucket_of]
            covered.update(params)
            block.register_forward_pre_hook(self._waiter({bucket_of[p] for p in params}))
        rest = {key for p, key in bucket_of.items() if p not in covered}
        module.register_forward_pre_hook(self._waiter(rest))

    def _waiter(self, keys: set[tuple[int, int]]) -> Callable:
        """A pre-hook waiting for the gathers of ``keys`` (buffer, bucket), the later buckets first."""
        def hook(module: nn.Module, args: tuple) -> None:
            for key in sorted(keys, reverse=True):
                work = self._gathers.pop(key, None)
                if work is not None:
                    work.wait()

        return hook


def _host_transfers(buffers: list[ParamGradBuffer], device: torch.device,
                    placement: StatePlacement) -> HostTransfers | None:
    """CUDA + an offloaded optimizer state: the grad shards' trip down and the parameters' trip up."""
    where = placement.optimizer_state
    if device.type != "cuda" or where == Placement.DEVICE:
        return None
    buckets = [(buf, b) for buf in buffers for b in buf.buckets]
    ring = disk_buffer_width([b.shard_numel for _, b in buckets], placement.offload_buffer_size)
    return HostTransfers(buckets, persistent_master=where == Placement.HOST,
                         ring_numel=ring if where == Placement.DISK else 0)
