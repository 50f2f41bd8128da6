"""Validation loss: the forward-only walk (``pipeline/forward_only.py``) over held-out global batches.

The mean loss is reduced like the training loss (``pipeline.runner.reduce_loss``):
averaged over dp x cp and known on every rank. With the run's document flags each
batch's documents are masked and its loss scaled as in training. With multi-token prediction each depth's
loss (``val_mtp_<k>_loss``, unweighted) is reduced as the training step's (``training/mtp_step.py``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..data.sampler import to_device
from ..model.documents import PackingRule
from ..parallel.state import ParallelState
from ..pipeline.forward_only import forward_only
from ..pipeline.runner import reduce_loss
from .mtp_step import mtp_step_of


def evaluate(chunks: list[nn.Module], batches, eval_iters: int, pstate: ParallelState,
             stage_shape: tuple[int, int, int], dtype: torch.dtype,
             packing: PackingRule | None = None) -> dict[str, float]:
    """Mean validation loss and perplexity over ``eval_iters`` global batches, and each MTP depth's mean loss.

    ``stage_shape``, ``dtype`` and ``packing`` are the training schedule's (``Schedule``).
    """
    for chunk in chunks:
        chunk.eval()
    losses, depth_losses = [], []
    try:
        for _ in range(eval_iters):
            micro_batches = [to_device(tokens, pstate.device) for tokens in batches.next_step()]
            walked = forward_only(chunks, micro_batches, pstate, stage_shape, dtype, packing)
            losses += walked.lm
            depth_losses += walked.mtp
    finally:
        for chunk in chunks:
            chunk.train()
    value = reduce_loss(losses, pstate)
    mtp = mtp_step_of(chunks, pstate)
    mtp.take(depth_losses)
    return {"val_loss": value, "val_ppl": math.exp(min(value, 50.0)), **mtp.fields(prefix="val_")}
