"""What moves parameters and gradients over the data-parallel (reduction) group: flat buffers and
buckets, the gradient-sync engine (ZeRO 0/1/2/3), the ZeRO-3 units, the parameter-shard offload and
the host transfers. The optimizer step (``megazero.optimizer``) sits on top; nothing here imports it."""
from .engine import GradSyncEngine

__all__ = ["GradSyncEngine"]
