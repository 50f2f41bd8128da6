"""The one place the training model is built: plain chunks, the --load weights, then the wrap, in a stated order.

``build_training_model`` is what every run, test harness and bench script calls. Each step of the wrap below
writes fields the model reads (``TransformerBlock.recompute``, ``compiled_body``, ``zero3_unit``) or installs
hooks the engine owns; ``print(model)`` shows every one of them (rank 0 prints it at start-up). A new
capability that wraps the model adds a step here, with the constraint that orders it.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint.load import load_model_weights
from ..config import Config
from ..data_parallel.engine import EngineSettings, GradSyncEngine
from ..model.aux_loss import AuxLossScaling
from ..model.chunk import blocks_of
from ..model.compile import apply_compile
from ..model.recompute import apply_recompute
from ..optimizer.scaler import DynamicLossScaler
from ..optimizer.zero import DistributedOptimizer
from ..parallel.state import ParallelState
from ..pipeline.p2p import verify_stage_shapes
from ..pipeline.partition import build_chunks
from ..run_plan import RunPlan
from ..tensor_parallel.random import DropoutRNG

Weights = tuple[str, dict[str, Any]]  # a checkpoint folder and its metadata (``run.find_checkpoint``)


@dataclass(frozen=True)
class TrainingModel:
    """This rank's wrapped chunks, the gradient-sync engine they are hooked into, the optimizer that steps it and
    the fp16 loss scaler (None otherwise): what the trainer, the checkpointer and the memory records take."""

    chunks: list[nn.Module]
    engine: GradSyncEngine
    optimizer: DistributedOptimizer
    scaler: DynamicLossScaler | None

    def close(self) -> None:
        """Release the offload stores (the optimizer's, and the engine's through it) on every exit path."""
        self.optimizer.close()

    def __repr__(self) -> str:
        engine = self.engine
        buckets = sum(len(buf.buckets) for buf in engine.buffers)
        scale = "dynamic loss scale" if self.scaler is not None else "no loss scale"
        head = (f"TrainingModel(zero {int(engine.stage)}, {buckets} bucket(s), "
                f"{'every micro-batch' if engine.reduction.every_micro_batch else 'once per step'}, "
                f"{scale}{', overlapped param gather' if engine.overlap_param_gather else ''})")
        return "\n".join([head, *(f"chunk {i}: {chunk!r}" for i, chunk in enumerate(self.chunks))])


def build_training_model(cfg: Config, plan: RunPlan, pstate: ParallelState, rng: DropoutRNG | None = None,
                         weights: Weights | None = None,
                         load_timer: AbstractContextManager[Any] | None = None) -> TrainingModel:
    """This rank's training model: the plain chunks, ``weights`` (the --load checkpoint) loaded into them, wrapped.

    The load comes between the build and the wrap: the optimizer's fp32 master copy is taken from the weights
    the chunks hold when it is built (and ZeRO 3 shards the full-size parameters then). ``rng``: the run's
    dropout streams; ``load_timer``: entered around the load alone (``startup_report.LoadTimer``).
    """
    chunks = build_model_chunks(cfg, plan, pstate, rng)
    if weights is not None:
        with load_timer or nullcontext():
            load_model_weights(weights[0], weights[1], chunks, pstate)
    return parallelize(chunks, plan, pstate, cfg)


def build_model_chunks(cfg: Config, plan: RunPlan, pstate: ParallelState,
                       rng: DropoutRNG | None = None) -> list[nn.Module]:
    """This rank's model chunk(s), initialised as slices of the seeded full model, in the compute dtype.

    ``rng``: the run's dropout streams (``dropout_rng``), which the saver and the loader get too.

    ``build_chunks`` draws the initial values in fp32 and casts them into compute-dtype storage; they
    reach the optimizer's fp32 master copy only through this cast (as Megatron). Also checks, with one
    all-gather over the pipeline group, that every stage expects the same activation shape and dtype
    (a mismatch raises on every rank before any send). Plain chunks: ``parallelize`` wraps them for training.
    """
    chunks = build_chunks(cfg, plan, pstate, rng)
    verify_stage_shapes(pstate, plan.stage_shape, next(chunks[0].parameters()).dtype)
    return chunks


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
    names = {p: name for chunk in chunks for name, p in chunk.named_parameters()}  # Muon's split rule reads them
    optimizer = DistributedOptimizer(sync, cfg.optimizer, scaler, (cfg.model, names))  # closes the engine if it fails
    return TrainingModel(chunks, sync, optimizer, scaler)
