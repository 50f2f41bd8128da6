"""The plain data-parallel AdamW: every rank keeps full grads and optimizer state.

Gradients are all-reduced (averaged) over the DP group in one coalesced call
after the last micro-batch, then clipped by the global norm and applied.
This is the DDP baseline the ZeRO optimizer is measured against.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..config import OptimizerConfig
from ..parallel.state import ParallelState
from .grads import _all_reduce_coalesced, clip_coefficient, counts_for_norm, global_norm, sync_replicated_grads


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool = False
    loss_scale: float | None = None


def param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (1-D) are not decayed."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class DataParallelAdamW:
    def __init__(self, modules: list[nn.Module], cfg: OptimizerConfig, pstate: ParallelState) -> None:
        self.cfg, self.pstate = cfg, pstate
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad]
        self.adam = torch.optim.AdamW(param_groups(self.params, cfg.weight_decay), lr=cfg.lr,
                                      betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches before the last one: grads just accumulate (communication happens in step)."""
        yield

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.pstate.dp_group is not None:
            _all_reduce_coalesced([p.grad for p in self.params], self.pstate.dp_group)
            for p in self.params:
                p.grad.div_(self.pstate.dp_size)
        sync_replicated_grads(self.params, self.pstate)
        local_sq = sum((p.grad.float().pow(2).sum() for p in self.params if counts_for_norm(p, self.pstate)),
                       torch.zeros((), device=self.pstate.device))
        norm = global_norm(local_sq, self.pstate)
        coef = clip_coefficient(norm, self.cfg.clip_grad)
        if coef < 1.0:
            for p in self.params:
                p.grad.mul_(coef)
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        return StepResult(grad_norm=norm)
