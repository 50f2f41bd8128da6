"""Pure rank arithmetic of the expert grid etp x ep x edp x pp, folded over the dense tp x cp x dp x pp world.

Mixture-of-experts layers lay the same ranks out a second way (Megatron's "parallel folding"): expert weights
split over etp ranks, the experts spread over ep ranks, and the rest of each pipeline stage's ranks
(edp = world / (etp * ep * pp)) hold copies whose gradients are averaged. Ranks vary fastest along etp, then
ep, then edp, then pp (Megatron's tp-ep-dp-pp order for the expert grid):

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))

Both grids put pp last over the same world, so a pipeline stage is the same set of ranks in both: EP may
borrow ranks from tp x cp x dp, never from another stage.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config_fields import ConfigError


@dataclass(frozen=True)
class ExpertCoords:
    etp: int
    ep: int
    edp: int
    pp: int


@dataclass(frozen=True)
class ExpertGrid:
    etp: int
    ep: int
    edp: int
    pp: int

    def __post_init__(self) -> None:
        assert min(self.etp, self.ep, self.edp, self.pp) >= 1, self

    @classmethod
    def fold(cls, world_size: int, pp: int, ep: int, etp: int) -> "ExpertGrid":
        """The expert grid of ``world_size`` ranks; a world it cannot fold into is a ConfigError naming the flags.

        Megatron's condition (``initialize_model_parallel``): etp * ep * pp divides the world, i.e. etp * ep
        divides the ranks of one pipeline stage.
        """
        fixed = etp * ep * pp
        if world_size % fixed != 0:
            stage = world_size // pp
            raise ConfigError(
                f"the expert grid --etp {etp} x --ep {ep} x --pp {pp} = {fixed} does not divide the world of "
                f"{world_size} ranks (etp x ep must divide the {stage} ranks of a pipeline stage); pick --ep/--etp "
                f"whose product divides {stage}, or launch a multiple of {fixed} processes.")
        return cls(etp=etp, ep=ep, edp=world_size // fixed, pp=pp)

    @property
    def world_size(self) -> int:
        return self.etp * self.ep * self.edp * self.pp

    def rank(self, etp: int, ep: int, edp: int, pp: int) -> int:
        return etp + self.etp * (ep + self.ep * (edp + self.edp * pp))

    def coords(self, rank: int) -> ExpertCoords:
        rest, etp = divmod(rank, self.etp)
        rest, ep = divmod(rest, self.ep)
        pp, edp = divmod(rest, self.edp)
        return ExpertCoords(etp=etp, ep=ep, edp=edp, pp=pp)

    def _groups(self, varying: tuple[str, ...]) -> list[list[int]]:
        """Ranks that share every expert coordinate but ``varying``, one list per group, in rank order."""
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(getattr(c, axis) for axis in ("etp", "ep", "edp", "pp") if axis not in varying)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def etp_groups(self) -> list[list[int]]:
        """The ranks one expert's weights are split over (--etp)."""
        return self._groups(("etp",))

    def ep_groups(self) -> list[list[int]]:
        """The ranks the experts are spread over; tokens are dispatched among them (--ep)."""
        return self._groups(("ep",))

    def edp_groups(self) -> list[list[int]]:
        """The ranks holding the same expert shard: expert gradients average, and ZeRO shards split, over them."""
        return self._groups(("edp",))

    def pp_groups(self) -> list[list[int]]:
        return self._groups(("pp",))
