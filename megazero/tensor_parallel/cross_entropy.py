"""Cross entropy over vocabulary-sharded logits, without ever building full-vocab logits.

Each rank holds logits for a contiguous slice of the vocabulary. Three small
all-reduces over TP give the pieces of log-softmax:

    m      = max_v z_v                          (MAX, for stability)
    Z      = sum_v exp(z_v - m)                 (SUM)
    z_t    = the target's logit, held by one rank (SUM of zeros elsewhere)
    loss   = log Z - (z_t - m)

Backward is softmax - one_hot(target) on each rank's own slice, with no
communication. Columns past the real vocabulary (padding) are masked to
-inf so padding never changes the math, whatever the TP size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import collectives as C
from ..parallel.state import group_rank, group_size


def padded_columns(rows: int, start: int, vocab_size: int | None) -> int:
    """How many of this rank's ``rows`` vocabulary columns (from ``start``) lie past the real vocabulary."""
    return 0 if vocab_size is None else min(rows, max(0, start + rows - vocab_size))


def softmax_and_loss(logits: torch.Tensor, target: torch.Tensor, group, start: int, padding: int,
                     out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three TP reductions: per-token loss [*], softmax [*, V/tp] (fp32, written into ``out``),
    and the target's local column with the mask of targets another rank holds."""
    rows = logits.shape[-1]
    distributed = group_size(group) > 1
    if padding < rows:  # padded columns are the last ones (of the last ranks): never the max
        # amax, not max(dim): max also computes indices and is ~20x slower on CPU
        logits_max = logits[..., : rows - padding].amax(dim=-1).float()
    else:
        logits_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
    if distributed:
        C.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
    softmax = torch.sub(logits, logits_max.unsqueeze(-1), out=out)

    local_target = target - start
    outside = (local_target < 0) | (local_target >= rows)
    local_target = local_target.masked_fill(outside, 0)
    target_logit = softmax.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

    softmax.exp_()
    if padding:
        softmax[..., rows - padding:] = 0.0  # exp(-inf): padding never enters the sum
    sum_exp = softmax.sum(dim=-1)
    if distributed:
        both = torch.stack([target_logit, sum_exp])
        C.all_reduce(both, group)
        target_logit, sum_exp = both[0], both[1]

    loss = sum_exp.log() - target_logit
    softmax.div_(sum_exp.unsqueeze(-1))
    return loss, softmax, local_target, outside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        rows = logits.shape[-1]
        start = group_rank(group) * rows
        # One vocabulary-sized allocation: it holds logits - max, then exp, then the softmax
        # saved for backward (fresh large buffers page-fault on every call on CPU).
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        loss, softmax, local_target, outside = softmax_and_loss(
            logits, target, group, start, padded_columns(rows, start, vocab_size), out)
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # reused in place: saved only for this backward
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss [*] from logits [*, V/tp] sharded over ``group`` and integer targets [*].

    ``vocab_size`` is the real vocabulary; columns past it are padding and are ignored.
    The returned gradient w.r.t. ``logits`` is in fp32 and cast back by autograd.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
