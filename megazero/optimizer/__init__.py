"""Optimizers: the ZeRO 0/1/2 distributed AdamW over bucketed buffers, LR schedule, grad bookkeeping."""
from .adam import StepResult, param_groups
from .zero import DistributedOptimizer, build_distributed_optimizer

__all__ = ["DistributedOptimizer", "StepResult", "build_distributed_optimizer", "param_groups"]
