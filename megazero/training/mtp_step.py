"""The trainer's side of multi-token prediction: each depth's loss of the step, as the log shows the LM loss.

Every training forward of the last stage leaves its depths' losses on the model (``model/mtp.py``: each the
rank's counted token losses x dp·cp·m / N_k). Their mean over the step's micro-batches, averaged over dp x cp,
is each depth's global per-token mean loss (unweighted by --mtp-loss-scaling-factor); the pipeline group then
sums the stages' rows (only the last stage's is non-zero), so every rank knows them. Evaluation reduces the
forward-only walk's rows the same way (``training/evaluate.py``: ``val_mtp_<k>_loss``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..config import ModelConfig
from ..model.mtp import mtp_depth_of
from ..parallel import collectives as C
from ..parallel.state import ParallelState


class NullMTPStep:
    """No MTP: nothing to take, nothing to record."""

    def after_step(self) -> None:
        """Nothing predicted."""

    def take(self, rows: Sequence[torch.Tensor]) -> None:
        """Nothing predicted."""

    def fields(self, prefix: str = "") -> dict[str, Any]:
        return {}


class MTPStep:
    """Takes the step's per-depth losses after the schedule and gives a logged step's ``mtp_<k>_loss`` fields."""

    def __init__(self, depth: int, pstate: ParallelState, chunks: Sequence[nn.Module]) -> None:
        self.depth, self.pstate = depth, pstate
        self.stacks: list[Any] = [chunk.mtp for chunk in chunks if getattr(chunk, "mtp", None) is not None]
        self.values = torch.zeros(depth, dtype=torch.float64, device=pstate.device)

    def after_step(self) -> None:
        """This rank's mean over the step's micro-batches (zeros off the last stage)."""
        self.take([v for stack in self.stacks for v in stack.take_values()])

    def take(self, rows: Sequence[torch.Tensor]) -> None:
        """This rank's mean of ``rows``, one [D] row of depth losses per micro-batch (none off the last stage)."""
        values = torch.stack(list(rows)).double().mean(dim=0) if rows else torch.zeros(self.depth, dtype=torch.float64)
        self.values = values.to(self.pstate.device)

    def fields(self, prefix: str = "") -> dict[str, Any]:
        """Collectives on every rank: the global per-token mean loss of each depth, as ``<prefix>mtp_<k>_loss``."""
        values = self.values.clone()
        if self.pstate.dp_cp_group is not None:
            C.all_reduce(values, self.pstate.dp_cp_group)
            values /= self.pstate.dp_cp
        C.all_reduce(values, self.pstate.pp_group)
        return {f"{prefix}mtp_{k}_loss": float(v) for k, v in enumerate(values.tolist(), start=1)}


def mtp_step(cfg: ModelConfig, pstate: ParallelState, chunks: Sequence[nn.Module]) -> MTPStep | NullMTPStep:
    """The step's MTP bookkeeping (decided by the config, so every stage joins the record's collectives)."""
    return MTPStep(cfg.mtp_depth, pstate, chunks) if cfg.mtp_depth else NullMTPStep()


def mtp_step_of(chunks: Sequence[nn.Module], pstate: ParallelState) -> MTPStep | NullMTPStep:
    """The same, decided by the chunks' model (every stage's chunks know D): what evaluation reduces with."""
    depth = mtp_depth_of(list(chunks))
    return MTPStep(depth, pstate, chunks) if depth else NullMTPStep()
