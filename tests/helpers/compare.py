"""Tensor comparison helpers for parity tests."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.parallel.state import group_size
from megazero.tensor_parallel.layers import spec_of


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|: a norm-wise relative error that is stable when entries are near zero."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual - expected).abs().max() / scale)


def gather_full(t: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    """Reassemble a TP-sharded tensor along ``dim`` (None: already full)."""
    if dim is None or group_size(group) == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def full_grads(module: torch.nn.Module, group) -> dict[str, torch.Tensor]:
    return {name: gather_full(p.grad, spec_of(p).split_dim, group) for name, p in module.named_parameters()
            if p.grad is not None}


def full_params(module: torch.nn.Module, group) -> dict[str, torch.Tensor]:
    return {name: gather_full(p.data, spec_of(p).split_dim, group) for name, p in module.named_parameters()}
