"""The one place plain model chunks become the training model, in a stated order.

Each step below writes fields the model reads (``TransformerBlock.recompute``, ``compiled_body``,
``zero3_unit``) or installs hooks the engine owns; ``print(model)`` shows every one of them. A new
capability that wraps the model adds a step here, with the constraint that orders it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import Config
from ..data_parallel.engine import EngineSettings, GradSyncEngine
from ..model.aux_loss import AuxLossScaling
from ..model.chunk import blocks_of
from ..model.compile import apply_compile
from ..model.recompute import apply_recompute
from ..optimizer.scaler import DynamicLossScaler
from ..optimizer.zero import DistributedOptimizer
from ..parallel.state import ParallelState
from ..run_plan import RunPlan


@dataclass(frozen=True)
class TrainingModel:
    """This rank's wrapped chunks and the optimizer that steps the engine they are hooked into."""

    chunks: list[nn.Module]
    optimizer: DistributedOptimizer

    def __repr__(self) -> str:
        sync = self.optimizer.sync
        buckets = sum(len(buf.buckets) for buf in sync.buffers)
        scale = "dynamic loss scale" if self.optimizer.scaler is not None else "no loss scale"
        head = (f"TrainingModel(zero {int(sync.stage)}, {buckets} bucket(s), "
                f"{'every micro-batch' if sync.reduction.every_micro_batch else 'once per step'}, "
                f"{scale}{', overlapped param gather' if sync.overlap_param_gather else ''})")
        return "\n".join([head, *(f"chunk {i}: {chunk!r}" for i, chunk in enumerate(self.chunks))])


def engine_settings(cfg: Config, plan: RunPlan) -> EngineSettings:
    """The gradient-sync engine's settings: the ZeRO stage and what the plan derived for it, buckets from ``cfg``."""
    return EngineSettings(stage=plan.zero, bucket_size=cfg.parallel.bucket_size,
                          main_grads_dtype=plan.main_grads_dtype,
                          overlap_param_gather=cfg.parallel.overlap_param_gather,
                          grad_reduction=plan.grad_reduction, gathering=plan.gathering, placement=plan.placement)


def parallelize(chunks: list[nn.Module], plan: RunPlan, pstate: ParallelState, cfg: Config) -> TrainingModel:
    """Wrap this rank's plain chunks (built and cast to ``plan.compute_dtype``) for training.

    The fp32 master copy the optimizer makes is the compute-dtype weights upcast: the fp32 initial values
    rounded to bf16/fp16 and back, as Megatron.
    """
    for chunk in chunks:
        assert all(p.dtype == plan.compute_dtype for p in chunk.parameters()), "cast the chunks first"
    t = cfg.training
    for chunk in chunks:
        # 1. recompute, before compile: which calls a compiled body runs eager follows the mode
        #    (apply_recompute refuses a compiled block)
        apply_recompute(blocks_of(chunk), t.recompute, t.recompute_num_layers)
        # 2. compile each block's body; its module hooks (step 3) stay eager around it
        if t.compile:
            apply_compile(chunk, t.compile_backend)
    # 3. the data-parallel engine: buckets, then per-parameter gradient hooks, ZeRO 3's units (their grad
    #    hooks after the buckets'), the gather waits - hooks on the finished modules, so after steps 1-2
    sync = GradSyncEngine(chunks, pstate, engine_settings(cfg, plan))
    # 4. loss scaling (fp16): a forward hook on each chunk scales its loss's backward; the grads it scales
    #    are what the engine's hooks accumulate and the optimizer unscales
    scaler = None
    if plan.compute_dtype == torch.float16:
        scaler = DynamicLossScaler(t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window)
        scaler.attach(chunks)
    # 5. MoE auxiliary losses: each chunk's routers scale them as its LM loss is scaled (model/aux_loss.py),
    #    the fp16 scale included, so this follows step 4
    AuxLossScaling(plan.micro_batches, pstate.cp, lambda: 1.0 if scaler is None else scaler.scale).attach(chunks)
    return TrainingModel(chunks, DistributedOptimizer(sync, cfg.optimizer, scaler))  # closes the engine if it fails
