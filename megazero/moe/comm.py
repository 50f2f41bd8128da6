"""The collectives that move tokens to their experts and back, as autograd Functions over rows (dim 0).

A token's rows travel with uneven counts (each rank sends what its router chose), so the one primitive
is an all-to-all with split sizes; its backward is the same all-to-all with the splits swapped. The
uneven all-gather and reduce-scatter over the expert-TP group are built from it, so autograd derives
their backwards (a repeat's backward is the sum that turns the reverse all-to-all into a reduce-scatter).
The dispatcher's token and output exchanges are issued asynchronously, with this rank's own expert work
recorded between the issue and the wait (``all_to_all_rows_overlapped``), forward and backward.
A group of one rank (``None``) makes every op the identity.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..parallel import collectives as C
from ..parallel.collectives import Group
from ..parallel.state import group_rank, group_size
from ..tensor_parallel.comm import all_gather_first_dim, all_reduce_in_place, reduce_scatter_first_dim


def _all_to_all(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))  # fresh and contiguous: gloo receives into nothing else
    C.all_to_all_single(out, x.contiguous(), group, out_splits=out_splits, in_splits=in_splits)
    return out


class _AllToAllRows(torch.autograd.Function):
    """Forward: ``in_splits[i]`` rows to rank i, ``out_splits[j]`` rows from rank j / backward: the reverse."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


class _InFlight:
    """One all-to-all of rows in flight each way: its handle and its output, shared by a start and a wait node."""

    def __init__(self) -> None:
        self.forward: tuple = (None, None)  # (work, received rows)
        self.backward: tuple = (None, None)  # (work, gradient rows on their way home)


def _start(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]) -> tuple:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return C.all_to_all_single(out, x.contiguous(), group, async_op=True, out_splits=out_splits,
                               in_splits=in_splits), out


class _StartRows(torch.autograd.Function):
    """Forward: issue the all-to-all, return an empty token / backward: wait for the gradients' return trip."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, flight):
        ctx.flight = flight
        flight.forward = _start(x, group, out_splits, in_splits)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        work, grad = ctx.flight.backward
        ctx.flight.backward = (None, None)  # the node must not keep what it returns: a cycle gc cannot free
        work.wait()
        return grad, None, None, None, None


class _WaitRows(torch.autograd.Function):
    """Forward: wait, return the received rows / backward: issue the reverse all-to-all of their gradient."""

    @staticmethod
    def forward(ctx, token, group, out_splits, in_splits, flight):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.flight = group, out_splits, in_splits, flight
        work, out = flight.forward
        flight.forward = (None, None)  # ctx.flight holding its own output would leak it (a cycle through the node)
        work.wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.flight.backward = _start(grad, ctx.group, ctx.in_splits, ctx.out_splits)
        return grad.new_empty(0), None, None, None, None


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather equal row blocks / backward: reduce-scatter (every rank used every row)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_first_dim(x, group).wait()

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_first_dim(grad, ctx.group).wait(), None


class _SumGrad(torch.autograd.Function):
    """Forward: identity / backward: all-reduce (Megatron's f, for a weight each rank applies to its own rows)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_in_place(grad.clone(), ctx.group).wait(), None


def all_to_all_rows_overlapped(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int],
                               work: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``in_splits[i]`` rows of ``x`` (in order) to rank i and receive the ``out_splits[j]`` rows from each
    j, with ``work()`` run while they travel: (received rows, what ``work`` returned).

    In backward the same overlap holds the other way round: the received rows' gradients travel home while
    autograd runs ``work``'s backward (it was recorded between the start and the wait, so the engine reaches
    it after issuing the reverse all-to-all and before waiting for it)."""
    if group_size(group) == 1:
        return x, work()
    flight = _InFlight()
    token = _StartRows.apply(x, group, out_splits, in_splits, flight)
    done = work()
    return _WaitRows.apply(token, group, out_splits, in_splits, flight), done


def all_gather_uneven_rows(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows in rank order (``sizes[r]`` from rank r); backward sums each row's grads home."""
    n = group_size(group)
    if n == 1:
        return x
    copies = x.repeat(n, *([1] * (x.ndim - 1)))  # one copy for every rank, this one included
    return _AllToAllRows.apply(copies, group, sizes, [x.shape[0]] * n)


def reduce_scatter_uneven_rows(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """``x`` holds ``sizes[r]`` rows for each rank r in order; return this rank's rows summed over the group."""
    n = group_size(group)
    if n == 1:
        return x
    mine = sizes[group_rank(group)]
    received = _AllToAllRows.apply(x, group, [mine] * n, sizes)
    return received.view(n, mine, *x.shape[1:]).sum(0)


def all_gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All ranks' equal row blocks; backward reduce-scatters (the all-gather dispatcher's token exchange)."""
    return x if group_size(group) == 1 else _GatherRows.apply(x, group)


def sum_grad_over(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity whose backward sums the gradient over ``group`` (a weight shared by ranks with different rows)."""
    return x if group_size(group) == 1 else _SumGrad.apply(x, group)

