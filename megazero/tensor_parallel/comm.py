"""Conjugate communication ops of tensor (and sequence) parallelism, as autograd Functions.

Megatron's paper names two: ``f`` (identity forward, all-reduce backward) in
front of a column-parallel layer and ``g`` (all-reduce forward, identity
backward) behind a row-parallel one. Sequence parallelism replaces the
pair by all-gather / reduce-scatter along the sequence (dim 0 of our
``[s, b, h]`` activations). Each op takes its group; ``None`` (a TP size of
1) makes it the identity. Collectives write into fresh tensors so autograd
never sees a shared gradient modified in place.
"""
from __future__ import annotations

import torch

from ..parallel import collectives as C
from ..parallel.state import group_rank, group_size


# -- raw collectives on a group ------------------------------------------------------------
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    C.all_reduce(out, group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    assert x.shape[dim] % size == 0, f"dim {dim} of {tuple(x.shape)} does not split over {size} ranks"
    # a copy, not a view: a view would keep the whole unsplit tensor alive as long as the slice
    return x.chunk(size, dim=dim)[group_rank(group)].clone(memory_format=torch.contiguous_format)


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    C.all_gather_into_tensor(out, x, group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    assert x.shape[0] % size == 0, f"dim {dim} of {tuple(x.shape)} does not split over {size} ranks"
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    C.reduce_scatter_tensor(out, x, group)
    return out.movedim(0, dim)


# -- autograd Functions ----------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    """f: forward identity / backward all-reduce (before a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: forward all-reduce / backward identity (after a row-parallel layer).

    In place: its input is a fresh GEMM (or embedding lookup) output that nothing else holds,
    so the copy ``_all_reduce`` makes would only cost memory traffic.
    """

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return _all_reduce(x, group)
        ctx.mark_dirty(x)
        C.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim / backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather the last dim / backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence / backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    """Forward: all-gather the sequence / backward: reduce-scatter it (the consumer is a
    TP layer whose input grads are partial sums) or just split it (replicated consumer)."""

    @staticmethod
    def forward(ctx, x, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter(grad, 0, ctx.group), None, None
        return _split(grad, 0, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence / backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


# -- public wrappers -----------------------------------------------------------------------------
def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over TP ranks, in place: pass a fresh partial result that nothing else uses."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, reduce_grad: bool = True) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group, reduce_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)
