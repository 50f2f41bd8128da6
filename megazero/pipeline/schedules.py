"""Forward/backward schedules over the micro-batches of one step.

Every schedule has one signature:

    schedule(chunks, micro_batches, pstate, no_sync) -> list[Tensor]

``chunks`` are this rank's model chunks, ``micro_batches`` the step's
[mb, seq+1] token tensors, ``no_sync`` a context manager factory from the
optimizer, entered for every backward but the step's last so gradient
communication waits for the final micro-batch. It returns the detached
per-micro-batch losses on the last pipeline stage (empty elsewhere).
Each micro-batch's loss is scaled by 1/m before backward, so accumulated
grads are those of the mean loss.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn

from ..parallel.state import ParallelState

NoSync = Callable[[], ContextManager]


def forward_backward_no_pipelining(chunks: list[nn.Module], micro_batches: list[torch.Tensor],
                                   pstate: ParallelState, no_sync: NoSync) -> list[torch.Tensor]:
    """pp = 1: forward and backward each micro-batch in turn, accumulating gradients."""
    assert len(chunks) == 1, "without pipeline parallelism a rank holds one model chunk"
    model, m = chunks[0], len(micro_batches)
    losses = []
    for i, tokens in enumerate(micro_batches):
        sync = contextlib.nullcontext() if i == m - 1 else no_sync()
        with sync:
            loss = model(tokens[:, :-1], tokens[:, 1:])
            (loss / m).backward()
        losses.append(loss.detach())
    return losses


def get_schedule(name: str, pstate: ParallelState):
    if pstate.pp_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError(f"pipeline schedule {name!r} is not built yet")
