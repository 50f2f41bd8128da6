"""What a mixture-of-experts layer needs to know about the parallel layout: its groups, nothing else.

The MoE layer sits on two grids at once: its input arrives on the dense one (``tp_group``, with or
without sequence parallelism; ``tp_cp_group`` the ranks sharing one sequence, over which the router
reduces its token counts) and its experts live on the expert one (``ep_group`` spreads the experts,
``etp_group`` splits each expert's weights). A group of one rank is ``None``, as everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..parallel.collectives import Group
from ..parallel.layout import Layout
from ..parallel.state import Degrees, ParallelState, group_rank

Dispatcher = Literal["alltoall", "allgather"]


@dataclass(frozen=True)
class ExpertContext(Degrees):
    """The groups of one MoE layer and how tokens travel between them.

    layout: the run's, whose ``tp``, ``ep`` and ``etp`` (``Degrees``) are these groups' sizes; one process
        by default.
    dispatcher: "alltoall" (dropless by default; tokens go only where their experts live) or
        "allgather" (every rank sees every token of its ep group; cheaper for small ep and large k).
    """

    layout: Layout = Layout(1, 1, 1)
    ep_group: Group = None
    etp_group: Group = None
    tp_cp_group: Group = None
    tp_group: Group = None
    sequence_parallel: bool = False
    dispatcher: Dispatcher = "alltoall"

    @classmethod
    def of(cls, pstate: ParallelState, sequence_parallel: bool = False,
           dispatcher: Dispatcher = "alltoall") -> "ExpertContext":
        """The groups of ``pstate``'s expert and dense grids."""
        return cls(layout=pstate.layout, ep_group=pstate.ep_group, etp_group=pstate.etp_group,
                   tp_cp_group=pstate.tp_cp_group, tp_group=pstate.tp_group, sequence_parallel=sequence_parallel,
                   dispatcher=dispatcher)

    @property
    def ep_rank(self) -> int:
        return group_rank(self.ep_group)

    @property
    def etp_rank(self) -> int:
        return group_rank(self.etp_group)
