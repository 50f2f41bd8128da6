"""Column/row-parallel linear layers and the vocab-parallel embedding.

Every parameter carries a ``ParamSpec`` saying how it is split over TP ranks
and how to initialise the *full* tensor. The full tensor is cut along its
split dim into ``INIT_BLOCK``-wide blocks, each drawn from its own generator
seeded by (seed, parameter name, block index); ``initialize_parameters``
draws only the blocks this rank's slice overlaps, so start-up costs a rank
its own parameters, while any TP size - and any pipeline split, since names
hold the global layer index - reproduces the serial model bit for bit.

Shapes: activations are ``[s, b, h]`` (sequence first), so sequence
parallelism shards the contiguous dim 0.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.state import group_rank, group_size
from .comm import (all_gather_first_dim, all_reduce_in_place, gather_from_tensor_parallel_region,
                   reduce_from_tensor_parallel_region, reduce_scatter_first_dim,
                   reduce_scatter_to_sequence_parallel_region)

TiedRole = Literal[None, "embedding", "embedding_copy"]


@dataclass
class ParamSpec:
    """How one parameter is split over TP ranks and initialised.

    split_dim: dim sharded across TP ranks, or None when every TP rank holds the full tensor.
    sequence_parallel: replicated, but each rank sees only its sequence chunk (or, for the
        --qk-layernorm head norms, its heads), so its gradient is a partial sum to all-reduce over TP.
    init_std: normal(0, std) when set, else the constant ``init_value``.
    valid_rows: rows past this (vocabulary padding) are zero and stay zero.
    weight_decay: AdamW decays it; by default matrices only, not biases and norm weights (1-D).
    tied_role: the word embedding tied across the first and last pipeline stage: "embedding" on
        the first stage, "embedding_copy" on the last. Their grads are summed over the embedding
        group, they get a bucket of their own, and the grad norm counts the original only.
    expert: a mixture-of-experts expert weight, stored [local experts, ...] (dim 0 is this rank's share of
        the experts over the expert-parallel group; ``split_dim`` then splits over the expert-TP group).
        Its gradient reduces over the expert-data-parallel group, not dp x cp.
    first_expert: an expert weight's global expert id of its local expert 0 (ep rank x local experts).
    expert_tp_rank: an expert weight's rank in the expert-TP group: which slice along ``split_dim`` it holds.
    """

    split_dim: int | None = None
    sequence_parallel: bool = False
    init_std: float | None = None
    init_value: float = 0.0
    valid_rows: int | None = None
    weight_decay: bool = True
    tied_role: TiedRole = None
    expert: bool = False
    first_expert: int = 0
    expert_tp_rank: int = 0


def _decays(param: torch.Tensor) -> bool:
    """The weight-decay rule: matrices are decayed; biases and norm weights (1-D) are not."""
    return param.ndim >= 2


def set_spec(param: nn.Parameter, **kwargs) -> nn.Parameter:
    kwargs.setdefault("weight_decay", _decays(param))
    param.spec = ParamSpec(**kwargs)
    return param


def spec_of(param: torch.Tensor) -> ParamSpec:
    spec = getattr(param, "spec", None)
    return ParamSpec(weight_decay=_decays(param)) if spec is None else spec


def full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    dim = spec_of(param).split_dim
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


INIT_BLOCK = 128  # rows (or columns) of the full tensor per seeded block, along the TP split dim


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of one block: a hash of (seed, name, block), so blocks are independent streams."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


@torch.no_grad()
def fill_normal_slice(out: torch.Tensor, *, seed: int, name: str, std: float, dim: int, start: int) -> None:
    """Write rows (along ``dim``) [start, start + out.shape[dim]) of the seeded normal(0, std) full tensor.

    Every block is drawn full-width in fp32, even where the tensor ends mid-block, so a value depends
    on (seed, name, its index) only - not on the TP size, nor on the full length (the padded
    vocabulary grows with tp). Only blocks overlapping the slice are drawn, one at a time, and cast
    into ``out`` (on any device): O(out.numel()) work and one block of scratch memory.
    """
    stop = start + out.shape[dim]
    shape = list(out.shape)
    shape[dim] = INIT_BLOCK
    for block in range(start // INIT_BLOCK, -(-stop // INIT_BLOCK)):
        lo, hi = max(start, block * INIT_BLOCK), min(stop, (block + 1) * INIT_BLOCK)
        generator = torch.Generator().manual_seed(block_seed(seed, name, block))
        drawn = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std)
        out.narrow(dim, lo - start, hi - lo).copy_(drawn.narrow(dim, lo - block * INIT_BLOCK, hi - lo))


@torch.no_grad()
def initialize_parameters(module: nn.Module, seed: int, tp_group) -> None:
    """Fill every parameter with this rank's slice of the full tensor that ``seed`` makes, drawing only that slice.

    A replicated parameter is its whole tensor, blocked along dim 0. Rows past ``valid_rows`` (global
    row index, dim 0) are zeroed.
    """
    rank = group_rank(tp_group)
    for name, param in module.named_parameters():
        spec = spec_of(param)
        if spec.init_std is None:
            param.fill_(spec.init_value)
            continue
        if spec.expert:
            _fill_experts(param, spec, seed, name, spec.init_std)
            continue
        dim = 0 if spec.split_dim is None else spec.split_dim
        start = 0 if spec.split_dim is None else rank * param.shape[dim]
        fill_normal_slice(param, seed=seed, name=name, std=spec.init_std, dim=dim, start=start)
        if spec.valid_rows is not None:
            first_row = start if dim == 0 else 0
            param[max(0, spec.valid_rows - first_row):].zero_()


def _fill_experts(param: torch.Tensor, spec: ParamSpec, seed: int, name: str, std: float) -> None:
    """Draw each local expert as the serial model draws it: seeded by "<name>.<global expert id>" and blocked
    along the expert's own split dim, so any ep and etp give the weights of ep 1, etp 1."""
    dim = 0 if spec.split_dim is None else spec.split_dim - 1
    start = 0 if spec.split_dim is None else spec.expert_tp_rank * param.shape[spec.split_dim]
    for local, expert in enumerate(param):
        fill_normal_slice(expert, seed=seed, name=f"{name}.{spec.first_expert + local}", std=std,
                          dim=dim, start=start)


def materialize(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """Give a module built on the meta device uninitialised storage on ``device`` in ``dtype``.

    Building on meta means no default initialiser runs and nothing full-size is allocated; the
    caller then runs ``initialize_parameters``. ``to_empty`` makes new Parameter objects, which
    drops the ``spec`` attribute, so specs are carried across by name.
    """
    specs = {name: p.spec for name, p in module.named_parameters() if hasattr(p, "spec")}
    module.to(dtype=dtype).to_empty(device=device)
    for name, param in module.named_parameters():
        if name in specs:
            param.spec = specs[name]


def _parameter(shape: tuple[int, ...], device, dtype, **spec) -> nn.Parameter:
    return set_spec(nn.Parameter(torch.empty(shape, device=device, dtype=dtype)), **spec)


class _ColumnParallelLinearFn(torch.autograd.Function):
    """Y = f(X) A^T + b, with f = identity (or the sequence all-gather under sequence parallelism).

    Forward: as F.linear on the (gathered) input.
    Backward: dX = dY A is computed first and its all-reduce over TP (reduce-scatter under
    sequence parallelism) is launched asynchronously; dA = dY^T X runs while it is in flight.
    This is the conjugate f of Megatron's paper with the communication hidden behind the
    weight-gradient GEMM. Under sequence parallelism only the local input shard is saved and
    re-gathered in backward, also overlapped (with the dX GEMM).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        total = all_gather_first_dim(x, group).wait() if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, sp = ctx.group, ctx.sequence_parallel
        gather = all_gather_first_dim(x, group, async_op=True) if sp else None  # the input for dA, while dX runs
        grad_input = grad_out.matmul(weight)
        if sp:
            total = gather.wait()
            reduce = reduce_scatter_first_dim(grad_input, group, async_op=True)
        else:
            total = x
            reduce = all_reduce_in_place(grad_input, group, async_op=True)
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = grad_2d.t().matmul(total.reshape(-1, total.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return reduce.wait(), grad_weight, grad_bias, None, None


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split along its output rows: each rank computes a slice of Y's features.

    Input: full features ([s, b, in]; with sequence parallelism [s/tp, b, in], all-gathered here).
    Output: [s, b, out/tp], or [s, b, out] when ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, init_std: float = 0.02,
                 device=None, dtype=None) -> None:
        super().__init__()
        tp = group_size(tp_group)
        assert out_features % tp == 0, f"out_features {out_features} does not split over tp={tp}"
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.weight = _parameter((out_features // tp, in_features), device, dtype, split_dim=0, init_std=init_std)
        self.bias = _parameter((out_features // tp,), device, dtype, split_dim=0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linear(x, self.weight, self.bias, self.tp_group, self.sequence_parallel)
        return gather_from_tensor_parallel_region(y, self.tp_group) if self.gather_output else y


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group,
                           sequence_parallel: bool) -> torch.Tensor:
    """Y = f(X) A^T + b for a weight held elsewhere too (the tied output head uses the embedding's)."""
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return _ColumnParallelLinearFn.apply(x, weight, bias, group, sequence_parallel)


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split along its input columns: each rank holds a partial sum of Y.

    Input: [s, b, in/tp] (the output of a column-parallel layer).
    Output: [s, b, out] all-reduced, or [s/tp, b, out] reduce-scattered with sequence parallelism.
    The bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group, bias: bool = True,
                 sequence_parallel: bool = False, init_std: float = 0.02, device=None, dtype=None) -> None:
        super().__init__()
        tp = group_size(tp_group)
        assert in_features % tp == 0, f"in_features {in_features} does not split over tp={tp}"
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = _parameter((out_features, in_features // tp), device, dtype, split_dim=1, init_std=init_std)
        self.bias = (_parameter((out_features,), device, dtype, sequence_parallel=sequence_parallel)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the (padded) vocabulary; each rank looks up the ids it owns.

    Input ids [b, s] -> output [s, b, h], all-reduced over TP (ids owned elsewhere contribute zeros).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group, valid_rows: int | None = None,
                 init_std: float = 0.02, device=None, dtype=None) -> None:
        super().__init__()
        tp = group_size(tp_group)
        assert num_embeddings % tp == 0, f"padded vocab {num_embeddings} does not split over tp={tp}"
        self.tp_group = tp_group
        self.rows_per_rank = num_embeddings // tp
        self.vocab_start = group_rank(tp_group) * self.rows_per_rank
        self.weight = _parameter((self.rows_per_rank, embedding_dim), device, dtype, split_dim=0,
                                 init_std=init_std, valid_rows=valid_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.t()  # [s, b]
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)  # in place: a fresh lookup nothing else holds
        return reduce_from_tensor_parallel_region(out, self.tp_group)


def scaled_init_std(std: float, num_layers: int) -> float:
    """GPT-2's residual-projection init: std / sqrt(2 * layers) keeps the residual stream's scale."""
    return std / math.sqrt(2.0 * num_layers)
