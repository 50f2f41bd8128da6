"""Pure rank arithmetic of a tp x dp x pp grid (no torch.distributed needed).

Ranks vary fastest along tp, then dp, then pp:

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so a TP group is a run of consecutive ranks (one node), and the DP groups of
one pipeline stage sit next to each other.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError


@dataclass(frozen=True)
class Coords:
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    pp: int

    def __post_init__(self) -> None:
        assert min(self.tp, self.dp, self.pp) >= 1, self

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int) -> "Layout":
        """Derive dp = world / (tp * pp); a world that does not factor is a clear error."""
        if tp > world_size or pp > world_size or world_size % (tp * pp) != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by --tp {tp} x --pp {pp} = {tp * pp}; "
                f"launch a multiple of {tp * pp} processes or change --tp/--pp.")
        return cls(tp=tp, dp=world_size // (tp * pp), pp=pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> Coords:
        return Coords(tp=rank % self.tp, dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp))

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def model_parallel_groups(self) -> list[list[int]]:
        """tp x pp ranks holding one full model replica (grad-norm and loss-scale agreement)."""
        return [[self.rank(t, d, p) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline (tied input/output embeddings)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp} (world {self.world_size})"
