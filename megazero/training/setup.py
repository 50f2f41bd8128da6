"""Build a run from a Config: groups, data, model chunks, optimizer, schedule, trainer.

Validation that needs no communication (flags, world size, batch arithmetic)
happens in ``validate`` before any process group exists, so bad input fails
the same way on every rank and nothing can hang.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..config import Config
from ..data import build_data
from ..model.gpt import GPTModel, count_parameters
from ..model.transformer import TPContext
from ..optimizer.accounting import memory_records
from ..optimizer.zero import DistributedOptimizer, build_distributed_optimizer
from ..parallel.layout import Layout
from ..parallel.state import ParallelState, default_device, init_distributed, world_size_from_env
from ..pipeline.schedules import build_schedule
from ..tensor_parallel.layers import initialize_parameters
from ..tensor_parallel.random import TensorParallelRNG, seed_everything
from .logging import MetricsLog
from .trainer import Trainer


def validate(cfg: Config, world_size: int) -> Layout:
    """Every check that needs only the config and the world size; raises ConfigError."""
    layout = Layout.from_world(world_size, cfg.parallel.tp, cfg.parallel.pp)
    cfg.check_tensor_parallel()
    cfg.check_batch(layout.dp)
    cfg.check_pipeline(layout.dp)
    return layout


def build_model_chunks(cfg: Config, pstate: ParallelState) -> list[nn.Module]:
    """This rank's model chunk(s), initialised as slices of the seeded full model.

    Also checks, with one all-gather over the pipeline group, that every stage expects
    the same activation shape (a mismatch raises on every rank before any send).
    """
    from ..pipeline.p2p import stage_shape, verify_stage_shapes
    from ..pipeline.partition import build_chunks

    chunks = build_chunks(cfg, pstate, cfg.check_pipeline(pstate.dp_size))
    verify_stage_shapes(pstate, stage_shape(cfg), next(chunks[0].parameters()).dtype)
    from ..model.recompute import apply_recompute

    for chunk in chunks:  # --recompute: checkpointing wrappers on this rank's blocks
        apply_recompute(chunk, cfg.training.recompute, cfg.training.recompute_num_layers)
    return chunks


def build_optimizer(cfg: Config, chunks: list[nn.Module], pstate: ParallelState) -> DistributedOptimizer:
    """The ZeRO optimizer for ``--zero``; casts the chunks to bf16/fp16 under --bf16/--fp16."""
    return build_distributed_optimizer(cfg, chunks, pstate)


def run(cfg: Config, log_fn=print) -> list[dict]:
    """Train with the world torchrun described; returns the logged records (the main entry point)."""
    layout = validate(cfg, world_size_from_env())
    device = default_device(cfg.training.device)
    init_distributed(device)
    rank = dist.get_rank()
    say = log_fn if rank == 0 else (lambda *_: None)
    say(f"megazero: building process groups for {layout} on {device}")
    pstate = ParallelState.build(layout, device)
    t = cfg.training
    data = build_data(data_path=cfg.data.data_path, tokenizer_model=cfg.data.tokenizer_model, split=cfg.data.split,
                      seq_length=cfg.model.seq_length, train_samples=t.train_iters * t.global_batch_size,
                      eval_samples=max(1, t.eval_iters) * t.global_batch_size, seed=t.seed,
                      is_builder=rank == 0, barrier=dist.barrier, log=say)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = data.tokenizer.vocab_size
    seed_everything(t.seed, pstate.pp_rank)
    chunks = build_model_chunks(cfg, pstate)
    say(f"megazero: {cfg.model.arch} model with {count_parameters(chunks[0], pstate.tp_size) / 1e6:.2f}M "
        f"parameters, {layout}, {cfg.check_batch(layout.dp)} micro-batches per step")
    from ..data import MicroBatchIterator

    batches = MicroBatchIterator(data.train, t.global_batch_size, t.micro_batch_size,
                                 pstate.dp_rank, pstate.dp_size)
    log = MetricsLog(cfg.logging.metrics_file, enabled=pstate.is_logging_rank)
    optimizer = build_optimizer(cfg, chunks, pstate)
    for record in memory_records(optimizer, chunks, pstate):  # model-state bytes of every rank
        log.record(record)
    trainer = Trainer(cfg, pstate, chunks, optimizer, build_schedule(cfg, pstate), batches, log)
    try:
        return trainer.train()
    finally:
        log.close()
