"""Tensor comparison helpers for parity tests."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from megazero.parallel.state import group_size
from megazero.tensor_parallel.layers import spec_of
from megazero.training.parallelize import TrainingModel


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


def precision_errors(run: dict, ref: dict) -> tuple[float, float]:
    """(worst relative loss / grad-norm error over the steps, norm-wise relative error of all the weights) of
    two runs' ``records`` and ``params``: one rounding of a bf16 weight is already 2^-8 of an entry, so
    reduced-precision runs are compared as a whole, not entry by entry."""
    assert len(run["records"]) == len(ref["records"])
    scalars = max(abs(r[k] - e[k]) / abs(e[k]) for r, e in zip(run["records"], ref["records"])
                  for k in ("loss", "grad_norm"))
    diff = sum(float((w.double() - ref["params"][name].double()).pow(2).sum()) for name, w in run["params"].items())
    size = sum(float(ref["params"][name].double().pow(2).sum()) for name in run["params"])
    return scalars, (diff / size) ** 0.5


@contextlib.contextmanager
def full_parameters(model: TrainingModel) -> Iterator[None]:
    """Every parameter of this rank's chunks readable inside (a collective over DP: call on every rank).

    ZeRO 3 gathers every unit for the duration (the whole TP/PP-local model on this rank, as
    FSDP's full state dict does) and frees them after; other stages wait for the last gather.
    """
    model.optimizer.wait_param_gather()
    units = model.engine.units
    if units is None:
        yield
        return
    units.gather_all()
    try:
        yield
    finally:
        units.free_all()
