"""The optimizer step: ZeRO 0/1/2/3 AdamW on the reduced shards (``zero.py``), norm and clipping, loss
scaling, LR schedule, the optimizer-state stores (device / host / disk) and the protocols checkpoints and
the trainer use. What moves parameters and gradients over the data-parallel group (buffers, buckets,
the gradient-sync engine, ZeRO-3 units, parameter offload) is ``megazero.data_parallel``, underneath."""
from .adam import StepResult
from .protocol import ShardedOptimizerState, TrainingOptimizer
from .zero import DistributedOptimizer

__all__ = ["DistributedOptimizer", "ShardedOptimizerState", "StepResult", "TrainingOptimizer"]
