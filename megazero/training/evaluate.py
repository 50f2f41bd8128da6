"""Validation loss: forward-only passes over held-out batches, through any pipeline layout.

The forward-only pass walks the virtual stages in order (stage k = chunk
k // pp of pipeline rank k % pp); the rank that owns a stage receives its
input from the previous one, runs it and sends the output on. No backward,
so there is nothing to overlap and no schedule is needed. The mean loss is
averaged over DP and broadcast from the last stage, like the training loss.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..data.sampler import to_device
from ..parallel import collectives as C
from ..parallel.state import ParallelState
from ..pipeline.p2p import StageLink


def reduce_loss(losses: list[torch.Tensor], pstate: ParallelState) -> float:
    """Mean of the last stage's micro-batch losses, averaged over DP and CP and known on every rank.

    A CP rank's loss is the mean over its S/cp tokens of each sample; the counts are equal, so the
    mean over the dp x cp group is the global token mean.
    """
    loss = torch.stack(losses).float().mean() if losses else torch.zeros((), device=pstate.device)
    if losses and pstate.dp_cp_group is not None:
        C.all_reduce(loss, pstate.dp_cp_group)
        loss /= pstate.dp_cp
    if pstate.pp_group is not None:  # only the last stage computed it
        C.broadcast(loss, pstate.stage_rank(pstate.pp - 1), pstate.pp_group)
    return float(loss)


@torch.no_grad()
def forward_only(chunks: list[nn.Module], tokens: torch.Tensor, pstate: ParallelState,
                 stage_shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor | None:
    """The loss of one micro-batch [b, s+1] on the last stage (None elsewhere).

    ``stage_shape`` and ``dtype`` are the activations' between stages (``RunPlan.stage_shape``,
    ``RunPlan.compute_dtype``), as in training.
    """
    pp, vp = pstate.pp, len(chunks)
    if pp == 1 and vp == 1:
        return chunks[0](tokens[:, :-1], tokens[:, 1:])
    link = StageLink(pstate, stage_shape, dtype)
    loss, x = None, None
    for k in range(pp * vp):
        if k % pp != pstate.pp_rank:
            continue
        chunk = chunks[k // pp]
        if k > 0:
            x = link.recv_forward().detach()
        out = chunk(tokens[:, :-1] if chunk.pre_process else x, tokens[:, 1:] if chunk.post_process else None)
        if chunk.post_process:
            loss = out
        else:
            link.send_forward(out)
    link.flush()
    return loss


def evaluate(chunks: list[nn.Module], batches, eval_iters: int, pstate: ParallelState,
             stage_shape: tuple[int, int, int], dtype: torch.dtype) -> dict[str, float]:
    """Mean validation loss and perplexity over ``eval_iters`` global batches."""
    for chunk in chunks:
        chunk.eval()
    losses = []
    try:
        for _ in range(eval_iters):
            for tokens in batches.next_step():
                loss = forward_only(chunks, to_device(tokens, pstate.device), pstate, stage_shape, dtype)
                if loss is not None:
                    losses.append(loss.float())
    finally:
        for chunk in chunks:
            chunk.train()
    value = reduce_loss(losses, pstate)
    return {"val_loss": value, "val_ppl": math.exp(min(value, 50.0))}
