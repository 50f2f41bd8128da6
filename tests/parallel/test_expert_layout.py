"""The expert grid (etp x ep x edp x pp folded over tp x cp x dp x pp) equals Megatron's rank arithmetic.

Pure tests compare every factorisation of worlds up to 16 with an independent transcription of Megatron's
rules (tests/helpers/megatron_ranks.py; always runs) and with megatron-core's own ``RankGenerator`` where it
is installed (``make bench`` installs it). One 8-rank gloo world checks that ParallelState builds exactly
those groups.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero.config import ConfigError
from megazero.parallel import collectives as C
from megazero.parallel.layout import Layout, describe_nodes
from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn
from tests.helpers.megatron_ranks import dense_groups, expert_groups, factorisations

CASES = factorisations(16)


def _layout(world: int, tp: int, cp: int, pp: int, etp: int, ep: int) -> Layout:
    return Layout.from_world(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)


def test_every_factorisation_up_to_16_is_covered():
    assert len(CASES) > 1000 and (16, 2, 2, 2, 2, 1, 8) in CASES and (12, 1, 3, 2, 2, 3, 2) in CASES


def test_expert_groups_equal_megatrons_rules_for_every_factorisation():
    for world, tp, cp, dp, pp, etp, ep in CASES:
        layout = _layout(world, tp, cp, pp, etp, ep)
        grid = layout.expert
        assert grid.edp == world // (etp * ep * pp)
        case = (world, tp, cp, dp, pp, etp, ep)
        assert grid.ep_groups() == expert_groups(world, pp, ep, etp, "ep"), case
        assert grid.etp_groups() == expert_groups(world, pp, ep, etp, "tp"), case
        assert grid.edp_groups() == expert_groups(world, pp, ep, etp, "dp"), case
        # Megatron asserts the pipeline groups are the same in both grids
        assert grid.pp_groups() == layout.pp_groups() == dense_groups(tp, cp, dp, pp, "pp"), case
        assert layout.tp_cp_groups() == dense_groups(tp, cp, dp, pp, "tp-cp"), case


def test_expert_groups_equal_megatron_core_rank_generator():
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    for world, tp, cp, dp, pp, etp, ep in CASES:
        grid = _layout(world, tp, cp, pp, etp, ep).expert
        theirs = parallel_state.RankGenerator(tp=etp, ep=ep, dp=grid.edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        case = (world, tp, cp, dp, pp, etp, ep)
        assert grid.ep_groups() == theirs.get_ranks("ep"), case
        assert grid.etp_groups() == theirs.get_ranks("tp"), case
        assert grid.edp_groups() == theirs.get_ranks("dp"), case
        dense = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        assert grid.pp_groups() == dense.get_ranks("pp"), case


def test_rank_and_expert_coords_round_trip():
    for world, tp, cp, _, pp, etp, ep in CASES[::7]:
        grid = _layout(world, tp, cp, pp, etp, ep).expert
        for rank in range(world):
            c = grid.coords(rank)
            assert grid.rank(c.etp, c.ep, c.edp, c.pp) == rank


@pytest.mark.parametrize("world, tp, cp, pp, etp, ep, product", [
    (8, 2, 1, 2, 2, 4, 16),  # etp x ep = 8 does not divide the 4 ranks of a stage
    (6, 1, 1, 1, 1, 4, 4),
    (12, 2, 1, 3, 1, 8, 24),
])
def test_a_world_the_expert_grid_cannot_fold_is_refused_in_one_line(world, tp, cp, pp, etp, ep, product):
    with pytest.raises(ConfigError) as err:
        _layout(world, tp, cp, pp, etp, ep)
    message = str(err.value)
    assert "\n" not in message and f"--etp {etp} x --ep {ep} x --pp {pp} = {product}" in message
    assert f"does not divide the world of {world} ranks" in message


def test_the_nodes_line_says_where_ep_groups_landed():
    layout = _layout(8, tp=2, cp=1, pp=1, etp=1, ep=4)  # ep groups {0,1,2,3} and {4,5,6,7}
    assert "ep groups inside one node" in describe_nodes(layout, [r // 4 for r in range(8)])
    assert "ep groups across 2 nodes" in describe_nodes(layout, [r // 2 for r in range(8)])
    assert "ep groups" not in describe_nodes(_layout(8, 2, 1, 1, 2, 1), [r // 4 for r in range(8)])


def test_serial_state_has_the_trivial_expert_grid():
    serial = ParallelState.serial()
    assert (serial.ep, serial.etp, serial.edp, serial.ep_rank, serial.etp_rank, serial.edp_rank) == (1, 1, 1, 0, 0, 0)
    assert serial.ep_group is serial.etp_group is serial.edp_group is serial.tp_cp_group is None


def _ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _mine(groups: list[list[int]], rank: int) -> list[int] | None:
    """The group holding ``rank``, or None where the groups are single ranks (ParallelState keeps no group)."""
    group = next(g for g in groups if rank in g)
    return None if len(group) == 1 else group


def _ledger_axes(pstate: ParallelState) -> set[str]:
    """The axes the ledger charges one all-reduce over each MoE group to."""
    pstate.ledger.enabled = True
    for group in (pstate.ep_group, pstate.etp_group, pstate.edp_group, pstate.tp_cp_group):
        C.all_reduce(torch.ones(2), group)
    return set(pstate.ledger.take())


def _built_groups(pstate: ParallelState) -> list[dict]:
    """On one 8-rank world, every layout below: the ranks of each MoE group and this rank's expert coordinates."""
    out: list[dict] = [{"axes": _ledger_axes(pstate)}]
    for tp, cp, pp, etp, ep in ((2, 2, 1, 1, 4), (2, 1, 2, 1, 2), (1, 2, 1, 2, 2)):
        state = pstate if (tp, cp, pp, etp, ep) == (2, 2, 1, 1, 4) else \
            ParallelState.build(_layout(8, tp, cp, pp, etp, ep), "cpu")
        out.append({"case": (tp, cp, pp, etp, ep), "ep": _ranks(state.ep_group), "etp": _ranks(state.etp_group),
                    "edp": _ranks(state.edp_group), "tp_cp": _ranks(state.tp_cp_group),
                    "coords": (state.etp_rank, state.ep_rank, state.edp_rank),
                    "reuses": (state.etp_group is state.tp_group, state.edp_group is state.dp_cp_group)})
    return out


def test_parallel_state_builds_the_groups_the_arithmetic_gives():
    results = spawn(_built_groups, 8, tp=2, cp=2, ep=4, etp=1)
    for rank, (charged, *built) in enumerate(results):
        assert charged["axes"] == {"all_reduce/ep", "all_reduce/edp", "all_reduce/tp_cp"}  # etp 1: no group
        for got in built:
            tp, cp, pp, etp, ep = got["case"]
            dp = 8 // (tp * cp * pp)
            assert got["ep"] == _mine(expert_groups(8, pp, ep, etp, "ep"), rank), got
            assert got["etp"] == _mine(expert_groups(8, pp, ep, etp, "tp"), rank), got
            assert got["edp"] == _mine(expert_groups(8, pp, ep, etp, "dp"), rank), got
            assert got["tp_cp"] == _mine(dense_groups(tp, cp, dp, pp, "tp-cp"), rank), got
            for group, coord in zip(("etp", "ep", "edp"), got["coords"]):
                assert coord == (got[group].index(rank) if got[group] else 0), got
            # a group with the ranks of a dense one is that group (a dense run makes no extra group)
            assert got["reuses"] == (expert_groups(8, pp, ep, etp, "tp") == dense_groups(tp, cp, dp, pp, "tp"),
                                     expert_groups(8, pp, ep, etp, "dp") == dense_groups(tp, cp, dp, pp, "cp-dp")), got
