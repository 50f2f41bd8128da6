"""Bytes the ZeRO optimizer holds at its high-water mark during real training steps.

CPU has no allocator peak counter, so ``StepStateMeter`` samples, from
outside the optimizer, the storages it holds, each counted once however many
views share it:

    params      the parameter buffers (``buf.param_data``); ZeRO 3: the parameter
                shards (``buf.param_shard_data``) and every bucket's full-size
                parameter storage (``b.param``: 0 bytes while its unit is freed)
    grads       the main-grad buffers (ZeRO 0/1), the grad shards (ZeRO 2/3), every
                full-size bucket gradient alive (``b.grad``: ZeRO 2/3 allocate them on
                a bucket's first gradient and free them when its reduce-scatter is
                retired), ZeRO 3's partial shards that each reduce-scatter writes into
                (held by the engine's in-flight list until the bucket retires), and inside
                ``step()`` the fp32 copies of the reduced shards it makes when main grads
                are not fp32 (the ``grad`` arguments of ``adamw_shard_step`` whose storage
                is not a buffer's: ``step()`` keeps them all in one list until its AdamW
                loop ends)
    optimizer   fp32 master weights and Adam moments

Sampling points: just after every allocation of model state - a bucket's
full-size parameters (``materialize_params``: ZeRO 3's gathers, forward and
backward), a bucket gradient (``bucket_grad``), a reduce-scatter's output (its
launch), an AdamW shard update's fp32 copy - and after every parameter's
gradient hook (ours is registered after the optimizer's). Memory only grows at
an allocation, so the largest sample of the sum is the step's high-water mark;
``record()`` gives the three parts at that moment (ZeRO 3's parameters and
gradients peak at different moments, and the planner counts them at the joint
peak) and, for reference, each part's own peak.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

import megazero.optimizer.zero as zero_mod
import megazero.parallel.collectives as collectives
from megazero.config import Config
from megazero.optimizer.zero import DistributedOptimizer
from megazero.parallel.state import ParallelState
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.training.parallelize import TrainingModel, build_training_model
from tests.helpers.batches import SyntheticBatches


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}


class StepStateMeter:
    """Peak params + grads + optimizer bytes of ``model``'s optimizer over the steps run while installed."""

    def __init__(self, model: TrainingModel) -> None:
        opt, self.engine = model.optimizer, model.engine
        self.opt = opt
        self.optimizer = sum(_storages(opt.store.tensors()).values())
        self.peak = {"total": 0, "params": 0, "grads": 0}
        self.peak_params = self.peak_grads = 0
        self._copies: dict[int, int] = {}
        self._copies_step = -1
        for buf in opt.buffers:
            for p in buf.params:
                p.register_post_accumulate_grad_hook(lambda p: self.sample())
            buf.materialize_params = self._after(buf.materialize_params)
            buf.bucket_grad = self._after(buf.bucket_grad)

    def _after(self, allocate):
        def wrapped(*args, **kwargs):
            out = allocate(*args, **kwargs)
            self.sample()
            return out

        return wrapped

    def held_params(self) -> dict[int, int]:
        bufs = self.opt.buffers
        return _storages([b.param_data for b in bufs] + [b.param_shard_data for b in bufs]
                         + [k.param for b in bufs for k in b.buckets])

    def held_grads(self) -> dict[int, int]:
        bufs = self.opt.buffers
        partials = self.engine.inflight_partials
        return _storages([b.grad_data for b in bufs] + [b.grad_shard_data for b in bufs]
                         + [k.grad for b in bufs for k in b.buckets] + partials)

    def sample(self, extra_grads: int = 0) -> None:
        params, grads = sum(self.held_params().values()), sum(self.held_grads().values()) + extra_grads
        self.peak_params, self.peak_grads = max(self.peak_params, params), max(self.peak_grads, grads)
        if params + grads > self.peak["total"]:
            self.peak = {"total": params + grads, "params": params, "grads": grads}

    def _adamw(self, master, grad, *args, **kwargs) -> None:
        if self._copies_step != self.opt.step_count:  # a new step: its copies so far
            self._copies, self._copies_step = {}, self.opt.step_count
        storage = grad.untyped_storage()
        if storage.data_ptr() not in self.held_grads():
            self._copies[storage.data_ptr()] = storage.nbytes()
        self.sample(sum(self._copies.values()))
        return self._original(master, grad, *args, **kwargs)

    def _reduce_scatter(self, out, *args, **kwargs):
        """A reduce-scatter's output exists from its launch (ZeRO 3's partial shard, not yet in flight)."""
        storage = out.untyped_storage()
        self.sample(0 if storage.data_ptr() in self.held_grads() else storage.nbytes())
        return self._original_rs(out, *args, **kwargs)

    def __enter__(self) -> "StepStateMeter":
        self._original, self._original_rs = zero_mod.adamw_shard_step, collectives.reduce_scatter_tensor
        zero_mod.adamw_shard_step, collectives.reduce_scatter_tensor = self._adamw, self._reduce_scatter
        return self

    def __exit__(self, *exc) -> None:
        zero_mod.adamw_shard_step, collectives.reduce_scatter_tensor = self._original, self._original_rs

    def record(self) -> dict[str, int]:
        return {"params_bytes": self.peak["params"], "grads_bytes": self.peak["grads"],
                "optimizer_bytes": self.optimizer, "peak_params_bytes": self.peak_params,
                "peak_grads_bytes": self.peak_grads}


def run_metered(pstate: ParallelState, cfg: Config, steps: int = 2,
                on_built: Callable[[list[torch.nn.Module], DistributedOptimizer], None] = lambda chunks, opt: None,
                meter_type: type[StepStateMeter] = StepStateMeter) -> tuple[DistributedOptimizer, dict[str, Any]]:
    """Build ``cfg``'s training model (``on_built`` sees it before the first step) and run ``steps`` real steps
    (model, ZeRO optimizer, schedule) under a ``meter_type`` meter: (the optimizer, the meter's record)."""
    torch.manual_seed(cfg.training.seed)
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    model = build_training_model(cfg, plan, pstate)
    chunks, opt = model.chunks, model.optimizer
    on_built(chunks, opt)
    schedule = build_schedule(plan)
    batches = SyntheticBatches(cfg, pstate.dp_rank, pstate.dp)
    with meter_type(model) as meter:
        for _ in range(steps):
            opt.zero_grad()
            schedule(chunks, batches.next_step(), pstate, opt.no_sync)
            opt.step(1e-3)
    return opt, meter.record()


def measure_steps(pstate: ParallelState, cfg: Config, steps: int = 2) -> dict[str, Any]:
    """Run ``steps`` real training steps; this rank's peak bytes."""
    _, record = run_metered(pstate, cfg, steps)
    return {**record, "pp_rank": pstate.pp_rank, "rank": pstate.rank}
