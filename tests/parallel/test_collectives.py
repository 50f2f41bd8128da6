"""Group semantics of the collectives: ``None`` is a group of one rank (nothing to do), the world is named.

Passing the TP group at tp = 1 (``None``) must never reduce over every rank;
a world-wide reduction names ``pstate.world_group``. Each ParallelState
counts its own groups' bytes.
"""
from __future__ import annotations

import torch

from megazero.parallel import collectives as C
from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn


def _none_and_world(pstate: ParallelState) -> dict:
    x = torch.full((4,), float(pstate.rank + 1))
    assert C.all_reduce(x, None) is None
    C.all_reduce(x, None, async_op=True).wait()
    after_none = x.clone()
    C.broadcast(x, 0, None)
    gathered = torch.empty(4)
    C.all_gather_into_tensor(gathered, x, None)
    objects = C.all_gather_object(pstate.rank, None)
    pstate.ledger.enabled = True
    C.all_reduce(x, pstate.tp_group)  # tp = 1: None, like every trivial axis
    C.all_reduce(x, pstate.world_group)
    world_objects = C.all_gather_object(pstate.rank, pstate.world_group)
    return {"after_none": after_none, "gathered": gathered, "objects": objects, "tp_group": pstate.tp_group,
            "after_world": x, "world_objects": world_objects, "bytes": pstate.ledger.take()}


def test_none_is_a_no_op_and_the_world_group_reduces_over_the_world():
    world = 3
    for rank, out in enumerate(spawn(_none_and_world, world)):
        assert out["tp_group"] is None
        assert torch.equal(out["after_none"], torch.full((4,), float(rank + 1)))
        assert torch.equal(out["gathered"], out["after_none"]) and out["objects"] == [rank]
        assert torch.equal(out["after_world"], torch.full((4,), float(sum(range(1, world + 1)))))
        assert out["world_objects"] == list(range(world))
        assert set(out["bytes"]) == {"all_reduce/world", "all_gather_object/world"}


def _two_states(pstate: ParallelState) -> dict:
    other = ParallelState.build(pstate.layout, pstate.device)  # a second owner of the same grid
    pstate.ledger.enabled = other.ledger.enabled = True
    C.all_reduce(torch.ones(4), other.dp_group)
    return {"mine": pstate.ledger.take(), "other": other.ledger.take()}


def test_two_parallel_states_keep_their_own_ledgers():
    for out in spawn(_two_states, 2):
        assert out["mine"] == {} and set(out["other"]) == {"all_reduce/dp"}
    a, b = ParallelState.serial(), ParallelState.serial()
    assert a.ledger is not b.ledger and a.world_group is None
