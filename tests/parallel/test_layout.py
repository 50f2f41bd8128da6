"""Layout's rank arithmetic, checked in one process: the grid DESIGN.md documents.

rank = tp_rank + tp * (dp_rank + dp * pp_rank); TP groups are consecutive
ranks; the TP, DP and PP groups each partition the world; a model-parallel
group is one replica's tp x pp ranks; an embedding group is a pipeline's
first and last stage.
"""
from __future__ import annotations

import itertools

import pytest

from megazero.config import ConfigError
from megazero.parallel.layout import Coords, Layout

LAYOUTS = [Layout(1, 1, 1), Layout(2, 1, 1), Layout(1, 4, 1), Layout(1, 1, 3), Layout(2, 2, 2),
           Layout(4, 2, 1), Layout(2, 3, 2), Layout(1, 2, 4), Layout(8, 1, 2)]


def _partitions(groups: list[list[int]], world: int) -> bool:
    """Every rank in exactly one group."""
    flat = [r for g in groups for r in g]
    return sorted(flat) == list(range(world))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_rank_and_coords_round_trip(layout: Layout) -> None:
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert 0 <= c.tp < layout.tp and 0 <= c.dp < layout.dp and 0 <= c.pp < layout.pp
        assert layout.rank(c.tp, c.dp, c.pp) == rank
    for t, d, p in itertools.product(range(layout.tp), range(layout.dp), range(layout.pp)):
        rank = layout.rank(t, d, p)
        assert rank == t + layout.tp * (d + layout.dp * p)
        assert layout.coords(rank) == Coords(tp=t, dp=d, pp=p)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_tp_groups_are_consecutive_ranks(layout: Layout) -> None:
    for group in layout.tp_groups():
        assert group == list(range(group[0], group[0] + layout.tp))
        assert group[0] % layout.tp == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_groups_partition_the_world_along_their_axis(layout: Layout) -> None:
    world = layout.world_size
    for groups, size, varies in ((layout.tp_groups(), layout.tp, "tp"), (layout.dp_groups(), layout.dp, "dp"),
                                 (layout.pp_groups(), layout.pp, "pp")):
        assert _partitions(groups, world) and all(len(g) == size for g in groups)
        for g in groups:  # members differ only along their own axis
            coords = [layout.coords(r) for r in g]
            for axis in {"tp", "dp", "pp"} - {varies}:
                assert len({getattr(c, axis) for c in coords}) == 1, (layout, varies, g)
            assert [getattr(c, varies) for c in coords] == list(range(size))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_model_parallel_groups_are_one_replica_each(layout: Layout) -> None:
    groups = layout.model_parallel_groups()
    assert len(groups) == layout.dp and _partitions(groups, layout.world_size)
    for d, g in enumerate(groups):
        assert len(g) == layout.tp * layout.pp and {layout.coords(r).dp for r in g} == {d}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_embedding_groups_join_first_and_last_stage(layout: Layout) -> None:
    for pipeline, emb in zip(layout.pp_groups(), layout.embedding_groups()):
        assert emb == sorted({pipeline[0], pipeline[-1]})
        assert {layout.coords(r).pp for r in emb} == {0, layout.pp - 1}


def test_from_world_derives_dp_and_rejects_a_world_that_does_not_factor() -> None:
    assert Layout.from_world(12, tp=2, pp=3) == Layout(tp=2, dp=2, pp=3)
    assert Layout.from_world(1, tp=1, pp=1).world_size == 1
    for world, tp, pp in ((6, 4, 1), (4, 1, 8), (10, 2, 2)):
        with pytest.raises(ConfigError, match="--tp"):
            Layout.from_world(world, tp=tp, pp=pp)
