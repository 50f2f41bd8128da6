"""Which tokens of a sample each context-parallel rank holds.

Causal attention does more work for later tokens, so a contiguous split would
give the last of ``cp`` ranks 2·cp/(cp+1) of the mean work. The load-balanced
split cuts the sequence into 2·R chunks for a ring of R ranks and gives ring
rank ρ chunks ρ and 2R-1-ρ: every rank then holds one early and one late chunk
and does the same attention work.

With the hybrid (``a2a+p2p``), the cp ranks form R ring positions of U
consecutive ranks each (an all-to-all group: cp rank = ρ·U + u). Each ring
chunk is cut into U pieces and rank (ρ, u) holds piece u of both of ρ's chunks,
so the all-to-all inside the group rebuilds ρ's two chunks whole. Pure ring:
U = 1. Pure all-to-all (Ulysses, U = cp): the all-to-all rebuilds the whole
sequence, so any split balances; it is the contiguous one (rank u holds tokens
u·S/cp .. (u+1)·S/cp - 1), which needs S divisible by cp only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError


@dataclass(frozen=True)
class CPSplit:
    """The token split of a CP group of ``cp`` ranks whose all-to-all groups hold ``a2a`` ranks."""

    cp: int = 1
    a2a: int = 1  # U: 1 = ring only (p2p), cp = all-to-all only (a2a), between = a2a+p2p

    def __post_init__(self) -> None:
        assert self.cp >= 1 and self.a2a >= 1 and self.cp % self.a2a == 0, self

    @property
    def ring(self) -> int:
        """R: ring positions (all-to-all groups) around the CP group."""
        return self.cp // self.a2a

    @property
    def contiguous(self) -> bool:
        return self.ring == 1

    def divisor(self) -> int:
        """What the sequence length must be a multiple of."""
        return self.cp if self.contiguous else 2 * self.cp

    def check(self, seq_length: int, flag: str = "--seq-length") -> None:
        d = self.divisor()
        if seq_length % d:
            why = f"--cp {self.cp}" if self.contiguous else f"2 x --cp {self.cp} (the load-balanced split)"
            raise ConfigError(f"{flag} ({seq_length}) must be divisible by {d} = {why}; choose a sequence "
                              f"length that is a multiple of {d} or change --cp.")

    def positions(self, seq_length: int, cp_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of the tokens ``cp_rank`` holds, in its local order (long [seq_length / cp]), made on
        ``device`` (a host-made copy would sync with a GPU in every layer)."""
        self.check(seq_length)
        if self.cp == 1:
            return torch.arange(seq_length, device=device)
        local = seq_length // self.cp
        if self.contiguous:
            return torch.arange(cp_rank * local, (cp_rank + 1) * local, device=device)
        ring_rank, u = divmod(cp_rank, self.a2a)
        chunk = seq_length // (2 * self.ring)
        piece = chunk // self.a2a
        starts = (ring_rank * chunk + u * piece, (2 * self.ring - 1 - ring_rank) * chunk + u * piece)
        return torch.cat([torch.arange(s, s + piece, device=device) for s in starts])

    def take(self, x: torch.Tensor, dim: int, cp_rank: int) -> torch.Tensor:
        """This rank's tokens of ``x`` (whole sequence along ``dim``)."""
        if self.cp == 1:
            return x
        return x.index_select(dim, self.positions(x.shape[dim], cp_rank).to(x.device))

    def restore(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The whole sequence from every rank's part (``parts[r]`` from cp rank r): the inverse of ``take``."""
        if self.cp == 1:
            return parts[0]
        local = parts[0].shape[dim]
        order = torch.cat([self.positions(local * self.cp, r) for r in range(self.cp)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return torch.cat(parts, dim).index_select(dim, inverse.to(parts[0].device))
