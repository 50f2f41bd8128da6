"""Where each tensor of a rank sits in the layout-free checkpoint format, and which rank writes it.

Every tensor is stored under its canonical name with its full shape; a rank holds one region of it:

- a dense weight: its TP shard (``split_dim`` over tp), the same on every DP and CP rank, so DP x CP
  rank 0 of each (tp, pp) writes it into ``model_tp*_pp*``;
- an expert weight (``ParamSpec.expert``): the full tensor is [E, ...] indexed by global expert id; a
  rank holds its ep rank's E/ep experts (dim 0 from ``first_expert``) and its etp slice along
  ``split_dim``, the same on every expert-data-parallel rank, so edp rank 0 of each (etp, ep, pp)
  writes it into ``experts_etp*_ep*_pp*``;
- a persistent buffer (the router's ``expert_bias``): whole and identical on every rank of its stage
  (the trainer updates it from counts reduced over all of them), written as a replicated dense weight.

Loading intersects the region a rank needs with the saved regions, so any layout reads any other.
"""
from __future__ import annotations

import torch
from torch import nn

from ..parallel.state import ParallelState
from ..tensor_parallel.layers import full_shape, spec_of
from . import storage
from .slices import Region, expert_region, tp_region


def named_parameters(chunks: list[nn.Module]) -> dict[str, nn.Parameter]:
    """Canonical name -> parameter over all of this rank's chunks (names are unique per rank)."""
    named: dict[str, nn.Parameter] = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            assert name not in named, f"parameter {name} appears in two chunks of one rank"
            named[name] = p
    return named


def persistent_buffers(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Canonical name -> each buffer that is part of the model's state (``state_dict``), e.g. ``expert_bias``."""
    found: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        kept = chunk.state_dict(keep_vars=True)
        found.update({name: b for name, b in chunk.named_buffers() if name in kept})
    return found


def model_tensors(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Everything the model files hold: parameters and persistent buffers, by canonical name."""
    return {**named_parameters(chunks), **persistent_buffers(chunks)}


def region_of(tensor: torch.Tensor, pstate: ParallelState) -> tuple[list[int], Region]:
    """The full (layout-free) shape of ``tensor`` and the region of it this rank holds."""
    spec = spec_of(tensor)
    if not spec.expert:
        shape = list(full_shape(tensor, pstate.tp))
        return shape, tp_region(shape, spec.split_dim, pstate.tp_rank, pstate.tp)
    shape = list(full_shape(tensor, pstate.etp))
    shape[0] *= pstate.ep
    return shape, expert_region(shape, spec.split_dim, spec.first_expert, tensor.shape[0], spec.expert_tp_rank,
                                pstate.etp)


def writes(tensor: torch.Tensor, pstate: ParallelState) -> bool:
    """Whether this rank writes ``tensor`` (or, at ZeRO 0, its optimizer state): one copy of each region."""
    return (pstate.edp_rank if spec_of(tensor).expert else pstate.dp_cp_rank) == 0


def writes_any(pstate: ParallelState) -> bool:
    """Whether this rank writes some model tensor (it then needs host copies of its weights)."""
    return pstate.dp_cp_rank == 0 or pstate.edp_rank == 0


def weight_file(tensor: torch.Tensor, pstate: ParallelState) -> str:
    """The model file ``tensor`` goes into when this rank writes it."""
    if spec_of(tensor).expert:
        return storage.expert_file(pstate.etp_rank, pstate.ep_rank, pstate.pp_rank)
    return storage.model_file(pstate.tp_rank, pstate.pp_rank)
