"""Optimizers: the gradient-sync engine and the ZeRO 0/1/2 AdamW step over bucketed buffers, LR schedule."""
from .adam import StepResult, param_groups
from .grad_sync import GradSyncEngine
from .protocol import ShardedOptimizerState
from .zero import DistributedOptimizer, build_distributed_optimizer

__all__ = ["DistributedOptimizer", "GradSyncEngine", "ShardedOptimizerState", "StepResult",
           "build_distributed_optimizer", "param_groups"]
