"""The distributed AdamW: ZeRO stages 0, 1 and 2 over bucketed contiguous buffers.

Per step, for every bucket of every model chunk (``buffers.py``):

    backward hooks      p.grad -> p.main_grad (accumulate), p.grad = None
    bucket complete     (outside ``no_sync``) launch its DP communication, async:
                          zero 0: all-reduce the bucket (pre-divided by dp)
                          zero 1: reduce-scatter it in place into this rank's shard
                          zero 2: reduce-scatter it into the persistent grad shard,
                                  then free the full-size bucket gradient
    step()              wait; sum replicated grads (SP params over TP, tied
                        embedding over the embedding group) on the reduced
                        shards; unscale + overflow check (fp16); global norm
                        (summed in fp64); skip on overflow or a non-finite
                        norm; clip; AdamW on the fp32 master shard; cast back
                        into the parameter buffer; all-gather the updated
                        shards (async when ``overlap_param_gather``).

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
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..config import OptimizerConfig
from ..parallel import collectives as C
from ..parallel.state import ParallelState
from .adam import AdamHyper, ShardedAdamState, StepResult, adamw_shard_step, decay_runs
from .buffers import Bucket, ParamGradBuffer, merged_runs
from .grads import (_all_reduce_coalesced, clip_coefficient, counts_for_norm, global_norm, nonfinite_probe,
                    sum_squares_fp64)
from .scaler import DynamicLossScaler

# ZeRO 2: at most this many reduce-scatters in flight; launching another first waits for the oldest,
# so the full-size bucket gradients alive during backward are bounded (in flight + the one filling).
MAX_INFLIGHT_BUCKETS = 2


class DistributedOptimizer:
    """AdamW with ZeRO stage ``zero`` over ``pstate``'s DP group; the trainer's optimizer interface."""

    def __init__(self, modules: list[nn.Module], cfg: OptimizerConfig, pstate: ParallelState, *, zero: int = 0,
                 bucket_size: int = 10_000_000, main_grads_dtype: torch.dtype = torch.float32,
                 overlap_param_gather: bool = False, scaler: DynamicLossScaler | None = None) -> None:
        assert zero in (0, 1, 2), zero
        self.cfg, self.pstate, self.zero, self.scaler = cfg, pstate, zero, scaler
        sharded = zero >= 1
        self.buffers: list[ParamGradBuffer] = []
        for module in modules:
            params = [p for p in module.parameters() if p.requires_grad]
            dtypes = {p.dtype for p in params}
            assert len(dtypes) == 1, f"a model chunk must have one parameter dtype, got {dtypes}"
            self.buffers.append(ParamGradBuffer(
                params, bucket_size=bucket_size, num_shards=pstate.dp_size if sharded else 1,
                shard_rank=pstate.dp_rank if sharded else 0, param_dtype=dtypes.pop(),
                grad_dtype=main_grads_dtype, shard_grads=zero == 2, device=pstate.device))
        self.states = [ShardedAdamState([buf.param_shard(b) for b in buf.buckets]) for buf in self.buffers]
        self.norm_runs = [[_norm_runs(b, pstate) for b in buf.buckets] for buf in self.buffers]
        self.probe_runs = [[_norm_runs(b, pstate, counted=False) for b in buf.buckets] for buf in self.buffers]
        self.decay_runs = [[decay_runs(b.segments) for b in buf.buckets]
                           for buf in self.buffers]
        self.step_count = 0
        self._sync = True
        self._inflight: list[tuple[ParamGradBuffer, Bucket, object]] = []
        self._gathers: dict[tuple[int, int], object] = {}
        self.overlap_param_gather = overlap_param_gather and sharded and pstate.dp_group is not None
        for buf in self.buffers:
            for b in buf.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._grad_hook(buf, b))
        if scaler is not None:
            scaler.attach(modules)
        if self.overlap_param_gather:
            for i, module in enumerate(modules):
                self._register_gather_waits(i, module)

    # -- the trainer's interface ------------------------------------------------------------
    def zero_grad(self) -> None:
        assert not self._inflight, "zero_grad() while gradient communication is in flight"
        for buf in self.buffers:
            buf.zero_grad()
            for p in buf.params:
                p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate: buckets launch no communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        """Reduce, unscale, norm, clip and apply AdamW; or skip, agreed on every rank.

        A step is skipped (weights, fp32 master weights, moments and step count untouched) when fp16
        grads overflow (the scale halves) or, in any precision, when the global norm is not finite:
        ``min(1, c / nan)`` is 1 and ``c / inf`` is 0, so clipping cannot save such a step.
        """
        self.wait_param_gather()
        self._finish_grad_sync()
        self._sync_replicated_shards()
        grads = [[buf.grad_shard(b).float() for b in buf.buckets] for buf in self.buffers]  # fp32 [shard]
        scale = None
        if self.scaler is not None:
            at_floor = self.scaler.scale <= self.scaler.min_scale  # halving cannot help any more
            found_inf = self._unscale_and_check(grads, self.scaler.scale)
            self.scaler.update(found_inf)
            scale = self.scaler.scale
            if found_inf:
                return StepResult(grad_norm=float("nan"), skipped=True, loss_scale=scale, nonfinite=at_floor)
        norm = self._global_norm(grads)
        if not math.isfinite(norm):
            return StepResult(grad_norm=norm, skipped=True, loss_scale=scale, nonfinite=True)
        coef = clip_coefficient(norm, self.cfg.clip_grad)
        self.step_count += 1
        hyper = AdamHyper(lr=lr, weight_decay=self.cfg.weight_decay, beta1=self.cfg.adam_beta1,
                          beta2=self.cfg.adam_beta2, eps=self.cfg.adam_eps)
        for buf, state, gs, runs in zip(self.buffers, self.states, grads, self.decay_runs):
            for b, g, (master, exp_avg, exp_avg_sq), r in zip(buf.buckets, gs, state.views, runs):
                if coef < 1.0:
                    g.mul_(coef)
                adamw_shard_step(master, g, exp_avg, exp_avg_sq, r, hyper, self.step_count)
                if state.separate_master:
                    buf.param_shard(b).copy_(master)
        self._gather_params()
        return StepResult(grad_norm=norm, loss_scale=scale)

    def _global_norm(self, grads: list[list[torch.Tensor]]) -> float:
        """The global grad norm, summed in fp64; non-finite on every rank when any grad is."""
        local_sq = torch.zeros((), dtype=torch.float64, device=self.pstate.device)
        for norm_runs, probe_runs, gs in zip(self.norm_runs, self.probe_runs, grads):
            for runs, probe, g in zip(norm_runs, probe_runs, gs):
                sum_squares_fp64(g, runs, local_sq)
                nonfinite_probe(g, probe, local_sq)
        return global_norm(local_sq, self.pstate, sharded_over_dp=self.zero >= 1)

    def wait_param_gather(self) -> None:
        """Block until every updated parameter has arrived (before reading weights outside forward)."""
        for work in self._gathers.values():
            work.wait()
        self._gathers.clear()

    # -- checkpoint interface ----------------------------------------------------------------
    @property
    def shards_state_over_dp(self) -> bool:
        """ZeRO 1/2: each DP rank owns different state; ZeRO 0: every DP rank holds all of it."""
        return self.zero >= 1

    def state_segments(self) -> Iterator[tuple[nn.Parameter, int, dict[str, torch.Tensor]]]:
        """Per piece of a parameter this rank updates: (param, flat offset into the TP-local param,
        views of its fp32 master weights and moments). Checkpoints save and load through these."""
        for buf, state in zip(self.buffers, self.states):
            for b, (master, exp_avg, exp_avg_sq) in zip(buf.buckets, state.views):
                for seg in b.segments:
                    piece = slice(seg.lo, seg.hi)
                    yield seg.param, seg.param_lo, {"master": master[piece], "exp_avg": exp_avg[piece],
                                                    "exp_avg_sq": exp_avg_sq[piece]}

    def state_scalars(self) -> dict:
        return {"step": self.step_count, "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_state_scalars(self, scalars: dict) -> None:
        self.step_count = int(scalars.get("step", 0))
        if self.scaler is not None and scalars.get("scaler"):
            self.scaler.load_state_dict(scalars["scaler"])

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        """After loading master shards: cast them into the parameters and gather the full buckets."""
        for buf, state in zip(self.buffers, self.states):
            if state.separate_master:
                for b, (master, _, _) in zip(buf.buckets, state.views):
                    buf.param_shard(b).copy_(master)
        self._gather_params()
        self.wait_param_gather()

    # -- gradient communication -------------------------------------------------------------
    def _grad_hook(self, buf: ParamGradBuffer, b: Bucket) -> Callable[[nn.Parameter], None]:
        def hook(p: nn.Parameter) -> None:
            if p.grad is None:
                return
            assert not b.launched, ("a gradient reached a bucket already communicated this step; the schedule "
                                    "must run every backward but a chunk's last one inside optimizer.no_sync()")
            buf.bucket_grad(b)  # ZeRO 2: allocate the transient bucket gradient on first use
            p.main_grad.add_(p.grad)
            p.grad = None
            b.ready += 1
            if b.ready == len(b.params):
                b.ready = 0
                if self._sync:
                    self._launch(buf, b)

        return hook

    def _launch(self, buf: ParamGradBuffer, b: Bucket) -> None:
        """Start bucket ``b``'s DP reduction (averaged: the bucket is pre-divided by dp)."""
        grad_b, group = buf.bucket_grad(b), self.pstate.dp_group
        b.launched = True
        work = None
        if group is None:
            if self.zero == 2:
                buf.grad_shard(b).copy_(grad_b)
        else:
            grad_b.div_(self.pstate.dp_size)
            if self.zero == 0:
                work = C.all_reduce(grad_b, group, async_op=True)
            else:  # in place for ZeRO 1 (the shard is a view of grad_b), into the shard for ZeRO 2
                work = C.reduce_scatter_tensor(buf.grad_shard(b), grad_b, group, async_op=True)
        self._inflight.append((buf, b, work))
        self._reap(block=False)
        while self.zero == 2 and len(self._inflight) > MAX_INFLIGHT_BUCKETS:
            self._retire(*self._inflight.pop(0))  # bound the full-size bucket gradients alive at once

    def _reap(self, block: bool) -> None:
        """Retire finished reductions; ZeRO 2 frees their full-size bucket gradients."""
        pending = []
        for buf, b, work in self._inflight:
            if work is None or block or work.is_completed():
                self._retire(buf, b, work)
            else:
                pending.append((buf, b, work))
        self._inflight = pending

    @staticmethod
    def _retire(buf: ParamGradBuffer, b: Bucket, work) -> None:
        if work is not None:
            work.wait()
        buf.release(b)

    def _finish_grad_sync(self) -> None:
        """Launch buckets whose hooks did not (unused params, no backward) and wait for all."""
        for buf in self.buffers:
            for b in buf.buckets:
                if not b.launched:
                    self._launch(buf, b)
        self._reap(block=True)

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
        _all_reduce_coalesced(tp_views, self.pstate.tp_group)
        _all_reduce_coalesced(emb_views, self.pstate.embedding_group)

    def _unscale_and_check(self, grads: list[list[torch.Tensor]], scale: float) -> bool:
        """Divide grads by the loss scale; True when any rank saw inf/nan (all ranks agree)."""
        bad = torch.zeros((), dtype=torch.float32, device=self.pstate.device)
        for gs in grads:
            for g in gs:
                g.mul_(1.0 / scale)
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        for group in (self.pstate.model_parallel_group, self.pstate.dp_group):
            if group is not None:
                C.all_reduce(bad, group, op=dist.ReduceOp.MAX)
        return bool(bad > 0)

    # -- parameter all-gather -------------------------------------------------------------
    def _gather_params(self) -> None:
        """ZeRO 1/2: every rank updated its shard; gather the full buckets in forward order."""
        group = self.pstate.dp_group
        if self.zero == 0 or group is None:
            return
        for i, buf in enumerate(self.buffers):
            for b in reversed(buf.buckets):  # the last bucket holds the first layers
                work = C.all_gather_into_tensor(buf.param_bucket(b), buf.param_shard(b), group,
                                                async_op=self.overlap_param_gather)
                if self.overlap_param_gather:
                    self._gathers[(i, b.index)] = work

    def _register_gather_waits(self, index: int, module: nn.Module) -> None:
        """Each block (element of a ModuleList/ModuleDict) waits for its buckets just before its
        forward; parameters outside blocks (embeddings, head, final norm) at the chunk's start."""
        buf = self.buffers[index]
        bucket_of = {p: b.index for b in buf.buckets for p in b.params}
        covered: set[nn.Parameter] = set()
        for container in module.modules():
            if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
                for block in container.children():
                    params = [p for p in block.parameters() if p in bucket_of]
                    covered.update(params)
                    block.register_forward_pre_hook(self._waiter(index, {bucket_of[p] for p in params}))
        rest = {bucket_of[p] for p in buf.params if p not in covered}
        module.register_forward_pre_hook(self._waiter(index, rest))

    def _waiter(self, index: int, bucket_ids: set[int]) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            for j in sorted(bucket_ids, reverse=True):
                work = self._gathers.pop((index, j), None)
                if work is not None:
                    work.wait()

        return hook


def _norm_runs(b: Bucket, pstate: ParallelState, counted: bool = True) -> list[tuple[int, int]]:
    """Shard ranges [lo, hi) whose grads enter the global norm (or, ``counted=False``, do not)."""
    return merged_runs(b.segments, lambda seg: counts_for_norm(seg.param, pstate) == counted)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(training_cfg) -> torch.dtype:
    """The dtype the model computes in: bf16/fp16 when asked, fp32 otherwise."""
    return torch.bfloat16 if training_cfg.bf16 else torch.float16 if training_cfg.fp16 else torch.float32


def build_distributed_optimizer(cfg, chunks: list[nn.Module], pstate: ParallelState) -> DistributedOptimizer:
    """From a run ``Config``: cast the chunks to the compute dtype, then bucket them (``--zero``, ...)."""
    t, par = cfg.training, cfg.parallel
    dtype = compute_dtype(t)
    for chunk in chunks:
        chunk.to(dtype)  # the fp32 initial values seed the master copy only through this cast (as Megatron)
    main_grads = DTYPES[t.main_grads_dtype] if dtype != torch.float32 else torch.float32
    scaler = None
    if t.fp16:
        scaler = DynamicLossScaler(t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window)
    return DistributedOptimizer(chunks, cfg.optimizer, pstate, zero=par.zero, bucket_size=par.bucket_size,
                                main_grads_dtype=main_grads, overlap_param_gather=par.overlap_param_gather,
                                scaler=scaler)
