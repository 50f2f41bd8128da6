"""Two dropout RNG streams, as Megatron keeps them.

Outside TP regions every TP rank holds the same activations, so they must
draw the same dropout mask: the default torch generator, seeded alike on a
TP group. Inside TP regions (split attention heads, sequence-parallel
shards) each rank holds different data and must draw an independent mask:
``TensorParallelRNG.fork()`` swaps in a per-TP-rank stream for that block.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TensorParallelRNG:
    """A per-TP-rank RNG stream to fork into for dropout inside tensor-parallel regions."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device) -> None:
        self.device = device
        saved = _get_state(device)
        torch.manual_seed(seed + _TP_SEED_OFFSET + tp_rank)
        self.state = _get_state(device)
        _set_state(saved, device)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        saved = _get_state(self.device)
        _set_state(self.state, self.device)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(saved, self.device)

    def get_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self.state = state.clone()


def seed_everything(seed: int, pp_rank: int = 0) -> None:
    """Seed the shared stream: equal across TP and DP ranks, distinct per pipeline stage."""
    torch.manual_seed(seed + 100 * pp_rank)
