"""Bytes the ZeRO optimizer holds at its high-water mark during real training steps.

CPU has no allocator peak counter, so ``StepStateMeter`` samples, from
outside the optimizer, the storages it holds, each counted once however many
views share it:

    params      the parameter buffers (``buf.param_data``)
    grads       the main-grad buffers (ZeRO 0/1), the grad shards (ZeRO 2), every
                full-size bucket gradient alive (``b.grad``: ZeRO 2 allocates them on
                a bucket's first gradient and frees them when its reduce-scatter is
                retired), and inside ``step()`` the fp32 copies of the reduced shards
                it makes when main grads are not fp32 (the ``grad`` arguments of
                ``adamw_shard_step`` whose storage is not a buffer's: ``step()``
                keeps them all in one list until its AdamW loop ends)
    optimizer   fp32 master weights and Adam moments

Sampling points: after every parameter's gradient hook (ours is registered
after the optimizer's, so it runs once the gradient has been accumulated and,
at a bucket's last parameter, the bucket launched and older reductions
retired), and at every AdamW shard update inside ``step()``. Between two
samples the optimizer allocates no gradient storage it does not still hold at
the next one, so the largest sample is the step's high-water mark.
"""
from __future__ import annotations

from typing import Any

import torch

import megazero.optimizer.zero as zero_mod
from megazero.config import Config
from megazero.optimizer.zero import DistributedOptimizer
from megazero.parallel.state import ParallelState
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.training.run import build_model_chunks, build_optimizer
from tests.helpers.batches import SyntheticBatches


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}


class StepStateMeter:
    """Peak params/grads/optimizer bytes of ``opt`` over the steps run while installed."""

    def __init__(self, opt: DistributedOptimizer) -> None:
        self.opt = opt
        self.params = sum(_storages(b.param_data for b in opt.buffers).values())
        self.optimizer = sum(_storages(t for s in opt.states for t in s.tensors()).values())
        self.peak_grads = 0
        self._copies: dict[int, int] = {}
        self._copies_step = -1
        for buf in opt.buffers:
            for p in buf.params:
                p.register_post_accumulate_grad_hook(lambda p: self.sample())

    def held_grads(self) -> dict[int, int]:
        bufs = self.opt.buffers
        return _storages([b.grad_data for b in bufs] + [b.grad_shard_data for b in bufs]
                         + [k.grad for b in bufs for k in b.buckets])

    def sample(self, copies: int = 0) -> None:
        self.peak_grads = max(self.peak_grads, sum(self.held_grads().values()) + copies)

    def _adamw(self, master, grad, *args, **kwargs) -> None:
        if self._copies_step != self.opt.step_count:  # a new step: its copies so far
            self._copies, self._copies_step = {}, self.opt.step_count
        storage = grad.untyped_storage()
        if storage.data_ptr() not in self.held_grads():
            self._copies[storage.data_ptr()] = storage.nbytes()
        self.sample(sum(self._copies.values()))
        return self._original(master, grad, *args, **kwargs)

    def __enter__(self) -> "StepStateMeter":
        self._original = zero_mod.adamw_shard_step
        zero_mod.adamw_shard_step = self._adamw
        return self

    def __exit__(self, *exc) -> None:
        zero_mod.adamw_shard_step = self._original

    def record(self) -> dict[str, int]:
        return {"params_bytes": self.params, "grads_bytes": self.peak_grads, "optimizer_bytes": self.optimizer}


def measure_steps(pstate: ParallelState, cfg: Config, steps: int = 2) -> dict[str, Any]:
    """Run ``steps`` real training steps (model, ZeRO optimizer, schedule); this rank's peak bytes."""
    torch.manual_seed(cfg.training.seed)
    plan = RunPlan.resolve(cfg, pstate.layout)
    chunks = build_model_chunks(cfg, plan, pstate)
    opt = build_optimizer(cfg, plan, chunks, pstate)
    schedule = build_schedule(plan)
    batches = SyntheticBatches(cfg, pstate.dp_rank, pstate.dp)
    with StepStateMeter(opt) as meter:
        for _ in range(steps):
            opt.zero_grad()
            schedule(chunks, batches.next_step(), pstate, opt.no_sync)
            opt.step(1e-3)
    return {**meter.record(), "pp_rank": pstate.pp_rank, "rank": pstate.rank}
