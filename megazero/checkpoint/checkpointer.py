"""The trainer's one saver, whatever the flags: ``save`` / ``poll`` / ``finish`` / ``close`` / ``latest``.

``open_checkpointer`` builds it once per run: ``SyncCheckpointer`` (write, vote and publish inside the step
that saves), ``AsyncCheckpointer`` under --async-save (``async_save.py``), or ``NullCheckpointer`` for a run
that saves nothing (no --save, or --skip-train). The trainer calls the same methods on each, so it tests no
``None`` and probes no attribute (a null object, as nanochat's ``DummyWandb``).
"""
from __future__ import annotations

from typing import Any, Protocol

from ..config import Config
from ..optimizer.protocol import ModelState
from ..parallel.state import ParallelState
from ..run_plan import RunPlan
from .async_save import AsyncCheckpointer
from .save import CheckpointContext, describe_latest, save_checkpoint


class Checkpointer(Protocol):
    """What the training loop calls; every rank calls each method at the same point of the same step."""

    saves: bool  # False only for the null one: a signal then keeps its default action (nothing to save first)

    def save(self, iteration: int, consumed_samples: int) -> None:
        """Save the state after ``iteration`` (published now, or concluded by a later ``poll`` / ``finish``)."""
        ...

    def poll(self) -> None:
        """Every step: conclude a background save whose writers are all done."""
        ...

    def finish(self) -> None:
        """An orderly stop: wait for a pending save, vote and publish it (raises on every rank if any failed)."""
        ...

    def close(self) -> None:
        """An error exit that not every rank may share: let a writer end, run no collective, publish nothing."""
        ...

    def latest(self) -> str:
        """What the --save folder's ``latest`` names on disk now ('' when the run saves nothing)."""
        ...


class NullCheckpointer:
    """A run that saves nothing: every call does nothing."""

    saves = False

    def save(self, iteration: int, consumed_samples: int) -> None:
        """Nothing to save."""

    def poll(self) -> None:
        """Nothing pending."""

    def finish(self) -> None:
        """Nothing pending."""

    def close(self) -> None:
        """Nothing pending."""

    def latest(self) -> str:
        return ""


class SyncCheckpointer(NullCheckpointer):
    """Each save is written, voted and published (rank 0) before the step that saves returns."""

    saves = True

    def __init__(self, ctx: CheckpointContext) -> None:
        self.ctx = ctx

    def save(self, iteration: int, consumed_samples: int) -> None:
        save_checkpoint(self.ctx, iteration, consumed_samples)

    def latest(self) -> str:
        return describe_latest(self.ctx.root)


def open_checkpointer(cfg: Config, plan: RunPlan, pstate: ParallelState, model: ModelState, tp_rng: Any = None,
                      loaded: str | None = None, run_id: str | None = None) -> Checkpointer:
    """This run's saver of ``model`` (``training/parallelize.TrainingModel``) from its flags (--save,
    --async-save, --keep-last, --skip-train).

    ``loaded``: the checkpoint this run resumed from, which --keep-last never removes; ``run_id``: recorded in
    each checkpoint's metadata, so a resume from it continues the run.
    """
    ck = cfg.checkpoint
    if not ck.save or ck.skip_train:
        return NullCheckpointer()
    ctx = CheckpointContext(ck.save, cfg, plan, pstate, model, tp_rng=tp_rng, keep_last=ck.keep_last, loaded=loaded,
                            run_id=run_id)
    return AsyncCheckpointer(ctx) if ck.async_save else SyncCheckpointer(ctx)
