"""Context parallelism: the sequence of each sample split over ``cp`` ranks.

Only two places know about it: the token split (``split.CPSplit``: which global
positions a rank holds, applied to inputs, labels and positions) and the
attention core (``attention.cp_attention``: ring exchange of K/V, all-to-all to
head shards, or both). Everything else works on S/cp tokens as it would on S.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel.collectives import Group
from .split import CPSplit


@dataclass(frozen=True)
class CPContext:
    """What attention needs to know about this rank's CP group.

    ``a2a_group``: the U consecutive CP ranks that all-to-all heads for sequence (None when U = 1);
    ``ring_group``: the R ranks, one per all-to-all group, with the same index in theirs, that pass
    K/V around (None when R = 1). ``rank`` is this rank's index in the CP group.
    """

    group: Group = None
    rank: int = 0
    comm_type: str = "p2p"
    split: CPSplit = CPSplit()
    a2a_group: Group = None
    ring_group: Group = None

    @property
    def size(self) -> int:
        return self.split.cp

    @property
    def active(self) -> bool:
        return self.split.cp > 1


__all__ = ["CPContext", "CPSplit"]
