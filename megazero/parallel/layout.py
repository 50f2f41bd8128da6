"""Pure rank arithmetic of a tp x cp x dp x pp grid (no torch.distributed needed).

Ranks vary fastest along tp, then cp, then dp, then pp (Megatron's tp-cp-dp-pp order):

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a TP group is a run of consecutive ranks (one node), a CP group the next
tightest (its K/V exchange is per layer), and the DP groups of one pipeline
stage sit next to each other. CP ranks hold the same weights, so gradients are
averaged, and ZeRO shards cut, over the dp x cp group. Mixture-of-experts layers fold a second grid,
etp x ep x edp x pp, over the same ranks (``expert_layout.py``; ``Layout.expert``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from .expert_layout import ExpertGrid


@dataclass(frozen=True)
class Coords:
    tp: int
    dp: int
    pp: int
    cp: int = 0


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    pp: int
    cp: int = 1
    ep: int = 1  # expert-parallel degree (--ep): the experts are spread over ep ranks
    etp: int | None = None  # expert-tensor-parallel degree (--etp); None = tp, stored as tp

    def __post_init__(self) -> None:
        assert min(self.tp, self.dp, self.pp, self.cp, self.ep) >= 1, self
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        assert self.world_size % (self.expert_tp * self.ep * self.pp) == 0, self

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
                   etp: int | None = None) -> "Layout":
        """Derive dp = world / (tp * cp * pp) and fold the expert grid; a world that does not factor is a clear
        error (ConfigError naming the flags)."""
        fixed = tp * cp * pp
        if fixed > world_size or world_size % fixed != 0:
            named = f"--tp {tp} x --cp {cp} x --pp {pp}" if cp > 1 else f"--tp {tp} x --pp {pp}"
            change = "--tp/--cp/--pp" if cp > 1 else "--tp/--pp"
            raise ConfigError(f"world size {world_size} is not divisible by {named} = {fixed}; "
                              f"launch a multiple of {fixed} processes or change {change}.")
        ExpertGrid.fold(world_size, pp, ep, tp if etp is None else etp)
        return cls(tp=tp, dp=world_size // fixed, pp=pp, cp=cp, ep=ep, etp=etp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        """--etp as given, or tp (what ``etp`` holds once built; an int for type checkers)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert(self) -> ExpertGrid:
        """The expert grid etp x ep x edp x pp over the same ranks (``expert_layout.py``)."""
        return ExpertGrid.fold(self.world_size, self.pp, self.ep, self.expert_tp)

    def rank(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> Coords:
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return Coords(tp=tp, dp=dp, pp=pp, cp=cp)

    def _all(self) -> list[Coords]:
        return [self.coords(r) for r in range(self.world_size)]

    def _groups(self, varying: tuple[str, ...]) -> list[list[int]]:
        """Ranks that share every coordinate but ``varying``, one list per group, in rank order."""
        groups: dict[tuple, list[int]] = {}
        for rank, c in enumerate(self._all()):
            key = tuple(getattr(c, axis) for axis in ("tp", "cp", "dp", "pp") if axis not in varying)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def tp_groups(self) -> list[list[int]]:
        return self._groups(("tp",))

    def cp_groups(self) -> list[list[int]]:
        return self._groups(("cp",))

    def dp_groups(self) -> list[list[int]]:
        return self._groups(("dp",))

    def dp_cp_groups(self) -> list[list[int]]:
        """The ranks holding the same weights: gradients average, and ZeRO shards split, over them."""
        return self._groups(("cp", "dp"))

    def pp_groups(self) -> list[list[int]]:
        return self._groups(("pp",))

    def tp_cp_groups(self) -> list[list[int]]:
        """The ranks that share one sequence (tp x cp): routing counts reduce over them."""
        return self._groups(("tp", "cp"))

    def model_parallel_groups(self) -> list[list[int]]:
        """tp x pp ranks holding one full model replica (grad-norm and loss-scale agreement)."""
        return self._groups(("tp", "pp"))

    def cp_subgroups(self, a2a: int) -> tuple[list[list[int]], list[list[int]]]:
        """Inside each CP group: all-to-all groups of ``a2a`` consecutive CP ranks, and the rings through them
        (the CP ranks with the same index in their all-to-all group)."""
        a2a_groups, rings = [], []
        for group in self.cp_groups():
            a2a_groups += [group[i:i + a2a] for i in range(0, len(group), a2a)]
            rings += [group[u::a2a] for u in range(a2a)]
        return a2a_groups, rings

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline (tied input/output embeddings)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def __str__(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        experts = f" ep={self.ep}" if self.ep > 1 else ""
        experts += f" etp={self.etp}" if self.etp != self.tp else ""
        return f"tp={self.tp}{cp} pp={self.pp} dp={self.dp}{experts} (world {self.world_size})"


# -- nodes: where the grid's groups land ------------------------------------------------------------
# torchrun gives each node (agent) LOCAL_WORLD_SIZE ranks and numbers them contiguously: the agent
# with GROUP_RANK g runs the ranks after those of agents 0..g-1 (torch.distributed.elastic's
# _assign_worker_ranks, for the static and the c10d rendezvous alike; c10d picks g itself, ignoring
# --node_rank). With the same --nproc_per_node everywhere, rank r runs on node r // ranks_per_node.


def contiguous_nodes(world_size: int, ranks_per_node: int) -> list[int]:
    """The node of each rank under torchrun's assignment (what every rank can know before any collective)."""
    assert ranks_per_node >= 1, ranks_per_node
    return [rank // ranks_per_node for rank in range(world_size)]


def check_tp_inside_nodes(layout: Layout, node_of_rank: list[int], allow_across: bool = False) -> None:
    """Refuse a layout whose TP group would span nodes (its all-reduces, twice per layer, would cross the network).

    Raises ConfigError naming --tp, the ranks per node and --allow-tp-across-nodes; ``allow_across``
    (that flag) accepts the layout.
    """
    if allow_across:
        return
    crossing = [g for g in layout.tp_groups() if len({node_of_rank[r] for r in g}) > 1]
    if not crossing:
        return
    per_node = [node_of_rank.count(n) for n in sorted(set(node_of_rank))]
    ranks = str(per_node[0]) if len(set(per_node)) == 1 else "/".join(map(str, per_node))
    raise ConfigError(
        f"--tp {layout.tp} puts TP group {crossing[0]} on nodes {sorted({node_of_rank[r] for r in crossing[0]})}, "
        f"but TP groups must stay inside a node ({ranks} ranks per node, LOCAL_WORLD_SIZE): use a --tp that "
        f"divides the ranks per node, or pass --allow-tp-across-nodes to accept the slower layout.")


def _node_span(name: str, groups: list[list[int]], node_of_rank: list[int]) -> str:
    """'tp groups inside one node' / 'dp groups across 2 nodes' (a range when groups differ)."""
    counts = sorted({len({node_of_rank[r] for r in g}) for g in groups})
    if counts == [1]:
        return f"{name} groups inside one node"
    return f"{name} groups across {_span(counts[0], counts[-1])} nodes"


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _stage_nodes(layout: Layout, node_of_rank: list[int]) -> str:
    """Which nodes hold each pipeline stage; the first two and the last when there are many stages."""
    spans = []
    for p in range(layout.pp):
        nodes = {node_of_rank[r] for r, c in enumerate(layout._all()) if c.pp == p}
        spans.append(f"{p} on node{'s' if len(nodes) > 1 else ''} {_span(min(nodes), max(nodes))}")
    shown = spans if len(spans) <= 4 else [*spans[:2], "...", spans[-1]]
    return "pp stage " + ", ".join(shown)


def describe_nodes(layout: Layout, node_of_rank: list[int]) -> str:
    """One line, however many ranks: the nodes, whether each kind of group stays inside one, the stages' nodes.

    e.g. ``2 nodes x 2 ranks (node n: ranks 2n..2n+1); tp groups inside one node; dp groups across 2 nodes;
    pp groups inside one node; pp stage 0 on nodes 0-1``.
    """
    nodes = sorted(set(node_of_rank))
    per_node = [node_of_rank.count(n) for n in nodes]
    if len(set(per_node)) == 1 and node_of_rank == contiguous_nodes(layout.world_size, per_node[0]):
        k = per_node[0]
        where = f"{len(nodes)} node{'s' if len(nodes) > 1 else ''} x {k} ranks"
        where += f" (node n: ranks {k}n..{k}n+{k - 1})" if len(nodes) > 1 and k > 1 else ""
    else:  # uneven nodes, or ranks not numbered node by node: each node's rank count
        where = f"{len(nodes)} nodes of {'/'.join(map(str, per_node))} ranks"
        where += "" if node_of_rank == sorted(node_of_rank) else ", ranks not numbered node by node"
    parts = [where] + [_node_span(name, groups, node_of_rank) for name, groups in
                       (("tp", layout.tp_groups()), ("cp", layout.cp_groups() if layout.cp > 1 else []),
                        ("dp", layout.dp_groups()), ("ep", layout.expert.ep_groups() if layout.ep > 1 else []),
                        ("pp", layout.pp_groups())) if groups]
    return "; ".join(parts + [_stage_nodes(layout, node_of_rank)])
