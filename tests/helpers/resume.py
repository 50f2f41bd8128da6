"""Train a segment of a run, from scratch or resumed from a checkpoint, saving at its end.

Shared by the ZeRO-3 checkpoint tests and the offload tests (a resumed run must continue the
uninterrupted one). Real pieces throughout: build functions, ZeRO optimizer, schedule, ``Trainer``,
the checkpoint's save and load functions.
"""
from __future__ import annotations

from typing import Any

import torch

from megazero.checkpoint import storage
from megazero.checkpoint.load import load_optimizer_state
from megazero.checkpoint.checkpointer import NullCheckpointer, SyncCheckpointer
from megazero.checkpoint.save import CheckpointContext
from megazero.config import Config
from megazero.parallel.state import ParallelState
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.training.metrics import MetricsLog
from megazero.training.parallelize import build_training_model
from megazero.training.trainer import Trainer
from tests.helpers.compare import full_parameters, full_params
from tests.helpers.optimizer_harness import SyntheticBatches, make_cfg

ITERS, SAVED_AT = 4, 2
EVAL = dict(eval_interval=SAVED_AT, eval_iters=1)  # evaluation under every stage, compared as well


def cfg_for(**kw: Any) -> Config:
    return make_cfg(**{"iters": ITERS, **EVAL, **kw})


class Batches(SyntheticBatches):
    """The synthetic batches from step ``step`` on (a resumed run continues the data where it stopped)."""

    def __init__(self, cfg: Config, pstate: ParallelState, step: int) -> None:
        super().__init__(cfg, pstate.dp_rank, pstate.dp)
        self.step, self.consumed_samples = step, step * cfg.training.global_batch_size


def segment(pstate: ParallelState, cfg: Config, *, load: str | None = None, save: str | None = None) -> dict:
    """Train to ``cfg``'s last iteration, from scratch or from ``load``, saving at the end into ``save``.

    Loading follows pretrain_gpt.py: weights into the full-size parameters before the optimizer
    exists (``build_training_model``; ZeRO 3 shards them when it is built), optimizer state after it.
    Returns the iteration records, the evaluation records and the final full weights (gathered over
    TP and, at zero 3, DP).
    """
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    found = None if load is None else (storage.resolve(load), storage.read_metadata(storage.resolve(load)))
    model = build_training_model(cfg, plan, pstate, weights=found)
    start = 0
    if found is not None:
        load_optimizer_state(*found, model, pstate)
        start = int(found[1]["iteration"])
    batches = Batches(cfg, pstate, start)
    ctx = CheckpointContext(save, cfg, plan, pstate, model) if save else None
    trainer = Trainer(cfg, pstate, model, build_schedule(plan), batches, MetricsLog(None, enabled=False),
                      start_iteration=start, eval_batches=lambda: Batches(cfg, pstate, 100),
                      checkpointer=SyncCheckpointer(ctx) if ctx else NullCheckpointer())
    records = trainer.train()
    params: dict[str, torch.Tensor] = {}
    with full_parameters(model):
        for chunk in model.chunks:
            params.update(full_params(chunk, pstate.tp_group))
    return {"records": [r for r in records if "event" not in r], "evals": [r for r in records if "event" in r],
            "params": params}
