"""The output head GEMM and the vocab-parallel cross entropy, fused and computed in token chunks.

Today's path (``column_parallel_linear`` then ``vocab_parallel_cross_entropy``) holds
the fp32 logits [tokens, V/tp] (as the softmax saved for backward) from forward to
backward. Here the forward loops over chunks of ``chunk_size`` tokens:

    z_c     = h_c W^T                               [c, V/tp], this rank's vocabulary slice
    loss_c  = log Z - (z_t - m)                     the three TP reductions of cross_entropy.py
    g_c     = softmax(z_c) - one_hot(target)        [c, V/tp] fp32, never kept
    dh_c    = g_c W                                 [c, h]
    dW     += g_c^T h_c                             [V/tp, h]

and keeps only dh (the gradient of the summed loss w.r.t. the head input) and dW; the
backward scales them by grad_output / tokens (the loss is the mean). With token weights
(``--eod-mask-loss``: 0 where no loss is counted) each token's loss and gradient row are
weighed before they are summed, and the loss is that weighted sum (the caller scales it). Peak memory
holds one chunk of logits instead of all of them (Liger-Kernel's fused linear cross
entropy, made vocab-parallel).

Tensor parallelism: dh is a partial sum over this rank's vocabulary slice; it is
summed over TP in forward (all-reduce, or reduce-scatter back to the sequence
shard under sequence parallelism, whose input is all-gathered first): the loss is
the same on every TP rank, so grad_output is too, and the scaling commutes with
the sum. The gradients are the summed loss's, in fp32 for dW when the weight is
bf16/fp16 (its sum over all tokens would lose precision or overflow), and only
then scaled, so fp16 loss scaling does not underflow them.
"""
from __future__ import annotations

import torch

from ..parallel.state import group_rank, group_size
from .comm import all_gather_first_dim, all_reduce_in_place, reduce_scatter_first_dim
from .cross_entropy import padded_columns, softmax_and_loss


def _chunk_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, group, start: int,
                         padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss [c] (fp32) and d(sum loss)/d(logits) [c, V/tp] (fp32) of one chunk of local logits,
    by ``cross_entropy.softmax_and_loss`` (max, sum-exp and target logit reduced over ``group``)."""
    # fp32 logits become the softmax in place (the chunk's logits are not needed after this)
    out = logits if logits.dtype == torch.float32 else torch.empty(logits.shape, dtype=torch.float32,
                                                                     device=logits.device)
    loss, grad, local_target, outside = softmax_and_loss(logits, target, group, start, padding, out)
    # softmax, then minus one-hot where the target is ours
    grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
    return loss, grad


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward: mean loss of (h W^T, target), or its token-weighted sum, chunk by chunk, with its gradients /
    backward: scale them."""

    @staticmethod
    def forward(ctx, x, weight, target, group, vocab_size, chunk_size, sequence_parallel, token_weights):
        total = all_gather_first_dim(x, group).wait() if sequence_parallel else x
        h_th = total.reshape(-1, total.shape[-1])  # [tokens, h], tokens in [s, b] order
        target_t = target.reshape(-1)
        assert h_th.shape[0] == target_t.shape[0], f"{h_th.shape[0]} tokens of input, {target_t.shape[0]} labels"
        weights_t = None if token_weights is None else token_weights.reshape(-1).to(torch.float32)
        rows = weight.shape[0]
        start = group_rank(group) * rows
        padding = padded_columns(rows, start, vocab_size)
        grad_h = torch.empty_like(h_th)
        exact = weight.dtype == torch.float32
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)
        for lo in range(0, h_th.shape[0], chunk_size):
            h_ch = h_th[lo: lo + chunk_size]
            logits_cv = torch.mm(h_ch, weight.t())
            loss_c, grad_cv = _chunk_loss_and_grad(logits_cv, target_t[lo: lo + chunk_size], group, start, padding)
            del logits_cv  # (or its softmax, when fp32: grad_cv is that buffer)
            if weights_t is not None:
                w_c = weights_t[lo: lo + chunk_size]
                loss_c = loss_c * w_c
                grad_cv.mul_(w_c.unsqueeze(-1))
            loss_sum += loss_c.sum()
            grad_cv = grad_cv.to(weight.dtype)
            torch.mm(grad_cv, weight, out=grad_h[lo: lo + chunk_size])
            if exact:
                grad_w.addmm_(grad_cv.t(), h_ch)
            else:
                grad_w.add_(torch.mm(grad_cv.t(), h_ch))
            del grad_cv  # before the next chunk's logits are allocated: one chunk buffer at a time
        grad_x = grad_h.view_as(total)
        if sequence_parallel:
            grad_x = reduce_scatter_first_dim(grad_x, group).wait()
        elif group_size(group) > 1:
            grad_x = all_reduce_in_place(grad_x, group).wait()
        ctx.divisor = h_th.shape[0] if weights_t is None else 1  # the mean, or the weighted sum as it is
        ctx.w_dtype = weight.dtype
        ctx.save_for_backward(grad_x, grad_w)
        return loss_sum / ctx.divisor

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        # a Python float: a bf16/fp16 grad_x is scaled in the kernel's fp32 math, not by a rounded scale
        scale = float(grad_loss) / ctx.divisor
        # in place: saved only for this backward (as cross_entropy.py reuses its softmax)
        grad_x = grad_x.mul_(scale) if ctx.needs_input_grad[0] else None
        grad_w = grad_w.mul_(scale).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None, None, None, None


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group, *,
                               vocab_size: int | None, chunk_size: int, sequence_parallel: bool = False,
                               token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean token loss of logits ``x W^T`` against ``target``, never holding all the logits; with
    ``token_weights`` ([s, b], as ``target``) the weighted sum of the token losses instead.

    x: [s, b, h] ([s/tp, b, h] under sequence parallelism, gathered here); weight: this rank's
    vocabulary slice [V/tp, h]; target: [s, b] token ids; ``vocab_size``: the real vocabulary
    (rows past it are padding); ``chunk_size``: tokens per chunk (> 0). Equals
    ``vocab_parallel_cross_entropy(column_parallel_linear(x, weight, ...), target, ...).mean()``
    (or ``(... * token_weights).sum()``).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 tokens, got {chunk_size}")
    sequence_parallel = sequence_parallel and group_size(group) > 1
    return _FusedLinearCrossEntropy.apply(x, weight, target, group, vocab_size, chunk_size, sequence_parallel,
                                          token_weights)
