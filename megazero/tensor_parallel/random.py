"""Dropout RNG streams, one pair per global layer (and one pair for the embedding).

Why per layer: a layer's masks must not depend on which pipeline rank or
virtual chunk holds it, nor on what other layers drew before, so a pipeline
run draws exactly the masks the serial run draws (the serial run is the
parity reference) and no two layers repeat each other's masks.

Why two kinds: outside TP regions every TP rank holds the same activations
and must draw the same mask - the *shared* stream, seeded by (seed, layer).
Inside TP regions (attention over split heads, every dropout under sequence
parallelism) each rank holds different data and needs an independent mask -
the *tensor-parallel* stream, seeded by (seed, layer, tp rank).

``F.dropout`` and ``scaled_dot_product_attention`` take no generator; they
draw from the device's default one. ``DropoutRNG.fork(name)`` therefore swaps
the stream's state into the default generator for the block and swaps it
back out afterwards, leaving the default generator as it was.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch

EMBEDDING = "embedding"


def stream_name(layer: int | str, tensor_parallel: bool) -> str:
    """``layer3.tp`` / ``layer3.shared``; ``layer`` is a global layer index or ``EMBEDDING``."""
    where = layer if layer == EMBEDDING else f"layer{int(layer)}"
    return f"{where}.{'tp' if tensor_parallel else 'shared'}"


def _stream_seed(seed: int, name: str, tp_rank: int) -> int:
    """A 63-bit seed that is stable across Python versions and distinct per (seed, stream, TP rank)."""
    key = f"{seed}/{name}" + (f"/tp{tp_rank}" if name.endswith(".tp") else "")
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class DropoutRNG:
    """This rank's dropout streams, created on first use from (seed, stream name, TP rank).

    A stream that was never drawn from needs no saved state: created later, it
    starts where it would have started anyway, so checkpoints hold only used ones.
    """

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str) -> None:
        self.seed, self.tp_rank, self.device = seed, tp_rank, torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def _state(self, name: str) -> torch.Tensor:
        if name not in self.states:
            gen = torch.Generator(self.device).manual_seed(_stream_seed(self.seed, name, self.tp_rank))
            self.states[name] = gen.get_state()
        return self.states[name]

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generator is left untouched."""
        saved = _get_state(self.device)
        _set_state(self._state(name), self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def snapshot(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The current states of ``names`` (recompute rewinds to them)."""
        return {name: self._state(name).clone() for name in names}

    def restore(self, states: dict[str, torch.Tensor]) -> None:
        self.states.update({name: s.clone() for name, s in states.items()})

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: s.clone() for name, s in self.states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: s.clone() for name, s in states.items()}



def seed_everything(seed: int, pp_rank: int = 0) -> None:
    """Seed the default generator (dropout draws from ``DropoutRNG`` streams, not from it)."""
    torch.manual_seed(seed + 100 * pp_rank)
