"""AdamW on flat shards: the arithmetic of ``torch.optim.AdamW``, applied to a bucket shard.

The distributed optimizer owns, per bucket, one contiguous shard of fp32
master weights and of the two moments. A shard spans pieces of several
parameters, so weight decay (``ParamSpec.weight_decay``: matrices, not biases
or norm weights) is applied per ``Segment``; everything else is one vectorised
update per shard.
The formulas and their order are torch's single-tensor AdamW, so one process
with this code reproduces ``torch.optim.AdamW`` on the same gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data_parallel.layout import Segment, merged_runs
from .pieces import Ranges, kept_in


@dataclass
class StepResult:
    """What one optimizer step did; every rank returns the same flags (the decisions are agreed).

    ``skipped``: the update was not applied (weights, moments and step count untouched), for any
    reason. ``nonfinite``: skipped because the gradients were not finite for a reason a smaller loss
    scale cannot explain: a non-finite global norm in fp32/bf16, or an fp16 overflow with the loss
    scale already at ``--min-loss-scale``. An fp16 overflow above the floor is the loss-scale search:
    ``skipped`` without ``nonfinite``. The trainer counts ``skipped_iterations`` from the first,
    ``nan_iterations`` from the second (or a non-finite loss), and stops after
    ``--max-skipped-steps`` consecutive ``nonfinite`` skips.
    """

    grad_norm: float
    skipped: bool = False
    loss_scale: float | None = None
    nonfinite: bool = False


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float


def decay_runs(segments: list[Segment]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The shard's (decayed, not decayed) runs; padding is in neither (zero grad and weight stay zero)."""
    return merged_runs(segments, lambda seg: seg.decay), merged_runs(segments, lambda seg: not seg.decay)


@torch.no_grad()
def adamw_shard_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     runs: tuple[list[tuple[int, int]], list[tuple[int, int]]], h: AdamHyper, step: int,
                     sq_runs: tuple[list[tuple[int, int]], list[tuple[int, int]]] | None = None) -> None:
    """One AdamW step on a shard. master, grad, exp_avg: [shard_numel] fp32; exp_avg_sq the same, or (``sq_runs``:
    where each of ``runs``' ranges sits in it) a compact one holding only the AdamW elements (``--optimizer muon``).

    ``runs`` are the shard's decayed and undecayed ranges (``decay_runs``). The update is
    torch's fused AdamW kernel (what ``torch.optim.AdamW(fused=True)`` runs): one pass over
    memory instead of the seven an op-by-op update makes, several times faster on CPU too.
    """
    steps = torch.full((), float(step), device=master.device)  # filled on the device: no host-to-device copy
    for decay, ranges, sq_ranges in zip((h.weight_decay, 0.0), runs, sq_runs or runs):
        if not ranges:
            continue
        views = [[t[lo:hi] for lo, hi in ranges] for t in (master, grad, exp_avg)]
        views.append([exp_avg_sq[lo:hi] for lo, hi in sq_ranges])
        torch._fused_adamw_(*views, [], [steps] * len(ranges), lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                            weight_decay=decay, eps=h.eps, amsgrad=False, maximize=False)


class ShardedAdamState:
    """fp32 master weights and moments for this rank's shard of every bucket of one buffer.

    When the compute dtype is fp32 the parameter buffer's own shard is the
    master copy (no second fp32 copy is kept); otherwise a separate fp32
    tensor holds it and updated values are cast back into the parameters.
    ``kept`` (Muon): per shard, the ranges that keep a second moment (``pieces.kept_in``); None: all of it.
    """

    def __init__(self, param_shards: list[torch.Tensor], kept: list[Ranges | None] | None = None) -> None:
        total = sum(t.numel() for t in param_shards)
        kept = kept or [None] * len(param_shards)
        sq_numels = [kept_in(k, 0, t.numel()) for k, t in zip(kept, param_shards)]
        device = param_shards[0].device if param_shards else torch.device("cpu")
        self.separate_master = bool(param_shards) and param_shards[0].dtype != torch.float32
        self.master_data = None
        if self.separate_master:
            self.master_data = torch.cat([t.float() for t in param_shards])
        self.exp_avg_data = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq_data = torch.zeros(sum(sq_numels), dtype=torch.float32, device=device)
        self.views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        offset = sq = 0
        for t, n_sq in zip(param_shards, sq_numels):
            sl = slice(offset, offset + t.numel())
            master = self.master_data[sl] if self.separate_master else t
            self.views.append((master, self.exp_avg_data[sl], self.exp_avg_sq_data[sq:sq + n_sq]))
            offset, sq = offset + t.numel(), sq + n_sq

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this state owns (for memory accounting)."""
        own = [self.exp_avg_data, self.exp_avg_sq_data]
        return own + ([self.master_data] if self.master_data is not None else [])
