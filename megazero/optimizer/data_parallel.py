"""Plain data parallelism (DDP semantics): the distributed optimizer at ZeRO stage 0.

Kept as a name for callers that want the DDP baseline without a run config;
``StepResult`` and ``param_groups`` now live in ``megazero.optimizer.adam``.
"""
from __future__ import annotations

from torch import nn

from ..config import OptimizerConfig
from ..parallel.state import ParallelState
from .adam import StepResult, param_groups
from .zero import DistributedOptimizer

__all__ = ["DataParallelAdamW", "StepResult", "param_groups"]


class DataParallelAdamW(DistributedOptimizer):
    """Bucketed all-reduce of full gradients, full optimizer state on every rank (``--zero 0``)."""

    def __init__(self, modules: list[nn.Module], cfg: OptimizerConfig, pstate: ParallelState) -> None:
        super().__init__(modules, cfg, pstate, zero=0)
