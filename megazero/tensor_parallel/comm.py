"""Conjugate communication ops of tensor (and sequence) parallelism, as autograd Functions.

Megatron's paper names two: ``f`` (identity forward, all-reduce backward) in
front of a column-parallel layer and ``g`` (all-reduce forward, identity
backward) behind a row-parallel one. Sequence parallelism replaces the
pair by all-gather / reduce-scatter along the sequence (dim 0 of our
``[s, b, h]`` activations). Each op takes its group; ``None`` (a TP size of
1) makes it the identity. Collectives write into fresh tensors so autograd
never sees a shared gradient modified in place.

``f`` has no Function of its own: ``ColumnParallelLinear`` fuses it with its
GEMMs (``layers.py``) to hide the backward all-reduce behind the weight
gradient, using the dim-0 primitives below, which can run asynchronously.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..parallel import collectives as C
from ..parallel.collectives import Group
from ..parallel.state import group_rank, group_size


# -- raw collectives on a group ------------------------------------------------------------
class InFlight(NamedTuple):
    """A collective's result and the handle to wait for before reading it (None: already done)."""

    result: torch.Tensor
    work: Any = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.result


def all_reduce_in_place(x: torch.Tensor, group: Group, async_op: bool = False) -> InFlight:
    """Sum ``x`` over ``group`` into ``x`` itself (into a contiguous copy when ``x`` is not contiguous)."""
    out = x.contiguous()
    return InFlight(out, C.all_reduce(out, group, async_op=async_op))


def all_gather_first_dim(x: torch.Tensor, group: Group, async_op: bool = False) -> InFlight:
    """Concatenate every rank's ``x`` along dim 0 (the sequence of ``[s, b, h]``)."""
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    return InFlight(out, C.all_gather_into_tensor(out, x.contiguous(), group, async_op=async_op))


def reduce_scatter_first_dim(x: torch.Tensor, group: Group, async_op: bool = False) -> InFlight:
    """Sum ``x`` over ``group`` and keep this rank's chunk of dim 0."""
    size = group_size(group)
    assert x.shape[0] % size == 0, f"dim 0 of {tuple(x.shape)} does not split over {size} ranks"
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    return InFlight(out, C.reduce_scatter_tensor(out, x.contiguous(), group, async_op=async_op))


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return all_reduce_in_place(x.contiguous().clone(), group).wait()


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    assert x.shape[dim] % size == 0, f"dim {dim} of {tuple(x.shape)} does not split over {size} ranks"
    # a copy, not a view: a view would keep the whole unsplit tensor alive as long as the slice
    return x.chunk(size, dim=dim)[group_rank(group)].clone(memory_format=torch.contiguous_format)


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return all_gather_first_dim(x.movedim(dim, 0).contiguous(), group).wait().movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return reduce_scatter_first_dim(x.movedim(dim, 0).contiguous(), group).wait().movedim(0, dim)


# -- autograd Functions ----------------------------------------------------------------------
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
def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over TP ranks, in place: pass a fresh partial result that nothing else uses."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)
