"""The optimizer as its two users see it.

``ShardedOptimizerState``: checkpoints (``megazero/checkpoint/``) - sharded state, piece by piece,
plus a few scalars. Checkpoint save/load depend on this protocol only, not on
``DistributedOptimizer``: any optimizer that can list the pieces of parameters whose state it
holds (and put loaded master weights back into the parameters) can be saved and resharded.

``TrainingOptimizer``: the training loop (``training/trainer.py``) - zero the grads, accumulate
without communication, step.

``ModelState``: the wrapped chunks with their optimizer as one value (``training/parallelize.TrainingModel``),
what checkpoints and the memory records take.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Iterator, Protocol

import torch
from torch import nn


class ShardedOptimizerState(Protocol):
    """Optimizer state split into per-parameter pieces, each owned by one DP rank (or by all)."""

    @property
    def shards_state_over_dp(self) -> bool:
        """True when each DP rank owns different state (ZeRO 1/2/3); False when every DP rank holds all of it."""
        ...

    @property
    def state_views_transient(self) -> bool:
        """True when ``state_segments``' views are reused for the next piece (disk offload): copy to keep."""
        ...

    def state_segments(self) -> Iterator[tuple[nn.Parameter, int, dict[str, torch.Tensor]]]:
        """Per piece this rank updates: (param, flat offset into the TP-local param, fp32 views by name)."""
        ...

    def state_scalars(self) -> dict[str, Any]:
        """Step count, loss scale and the like: identical on every rank."""
        ...

    def load_state_scalars(self, scalars: dict[str, Any]) -> None:
        ...

    def host_copies(self, keep: bool) -> dict[nn.Parameter, torch.Tensor]:
        """CPU copies of this rank's parameters when ``keep``; a collective over DP (ZeRO 3 gathers)."""
        ...

    def sync_params_from_master(self) -> None:
        """After loading master pieces: cast them into the parameters and make every rank's copy whole."""
        ...

    def wait_param_gather(self) -> None:
        """Block until every updated parameter has arrived (before a save reads the weights)."""
        ...


class TrainingOptimizer(Protocol):
    """What the training loop calls once per step (``StepResult`` from ``adam.py``)."""

    def zero_grad(self) -> None:
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Backwards inside only accumulate (every micro-batch but a chunk's last)."""
        ...

    def step(self, lr: float) -> Any:
        """Reduce, clip and update, or skip; returns the step's ``StepResult``."""
        ...


class ModelState(Protocol):
    """This rank's wrapped chunks and the optimizer whose shards hold their state."""

    @property
    def chunks(self) -> list[nn.Module]:
        ...

    @property
    def optimizer(self) -> ShardedOptimizerState:
        ...
