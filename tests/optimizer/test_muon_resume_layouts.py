"""Muon checkpoints of interleaved pipeline parallelism (virtual stages) and a2a context parallelism resume at
another layout and at the same one (issue 42, "Checkpoints"; the pattern of ``test_muon_checkpoints.py``).

One spawned world of 2 ranks, the tiny llama (GQA, 4 layers; Muon lr 0.02, AdamW lr 1e-3 for the rest), each
segment 2 iterations from the previous checkpoint: dp 2 ZeRO 1 -> pp 2 interleaved (2 chunks per rank) ->
pp 2 interleaved again (the same layout) -> cp 2 a2a (ZeRO 2) -> one process. Every resumed segment's loss and
grad norm lie within 1e-5 relative of the uninterrupted one-process run; the same-layout resume repeats an
interleaved run that never stopped bitwise (records and weights); the interleaved and a2a checkpoints, loaded
and saved at once at dp 2 ZeRO 1 (and the dp 2 one at both), hold bitwise the same full-shape weights, master
and momentum as the checkpoint they were loaded from.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn
from tests.helpers.moe_ckpt import full_contents, round_trip
from tests.helpers.moe_runs import layout_of
from tests.helpers.optimizer_harness import make_cfg
from tests.helpers.resume import segment
from tests.helpers.tiny_config import degrees, family

WORLD, STEP, TOL = 2, 2, 1e-5
MUON = dict(optimizer="muon", lr=0.02, muon_adam_lr=1e-3)
INTERLEAVED = dict(pp=2, vp=2, **degrees(schedule="interleaved"), zero=0)
A2A = dict(**degrees(cp=2, comm="a2a"), zero=2)
SEGMENTS = [("dp2.z1", dict(zero=1)), ("pp2.vp2", INTERLEAVED), ("pp2.vp2.same", INTERLEAVED), ("cp2.a2a", A2A)]
SAME = "pp2.vp2.same"
ROUND_TRIPS = {"dp2.z1.to.vp2": ("dp2.z1", INTERLEAVED), "dp2.z1.to.a2a": ("dp2.z1", A2A),
               "vp2.to.dp2": ("pp2.vp2", dict(zero=1)), "a2a.to.dp2": ("cp2.a2a", dict(zero=1))}


def cfg(iters: int, **layout: Any):
    return make_cfg(iters=iters, layers=4, seq_length=16, **family("llama"), **MUON, **layout)


def world(pstate: ParallelState, ck: str) -> dict[str, Any]:
    states: dict = {}

    def state(c) -> ParallelState:
        key = layout_of(c, pstate.layout.world_size)
        if key not in states:
            states[key] = ParallelState.build(key, "cpu")
        return states[key]

    out, source = {}, None
    for i, (name, layout) in enumerate(SEGMENTS, start=1):
        c = cfg(STEP * i, **layout)
        result = segment(state(c), c, load=source, save=f"{ck}/{name}")
        out[name] = {"records": result["records"], **({"params": result["params"]} if name == SAME else {})}
        source = f"{ck}/{name}"
    c = cfg(3 * STEP, **INTERLEAVED)  # the interleaved run from dp2.z1's checkpoint that never stopped
    out["straight"] = segment(state(c), c, load=f"{ck}/dp2.z1")
    for name, (origin, layout) in ROUND_TRIPS.items():
        c = cfg(STEP, **layout)
        round_trip(state(c), c, f"{ck}/{origin}", f"{ck}/{name}")
    return out


def _rows(records: list[dict]) -> list[tuple[int, float, float]]:
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    ck = str(tmp_path_factory.mktemp("muon_resume_layouts"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = ParallelState.serial()
        end = STEP * (len(SEGMENTS) + 1)
        return {"ck": ck, "ranks": spawn(world, WORLD, ck), "serial": _rows(segment(serial, cfg(end))["records"]),
                "resumed": segment(serial, cfg(end), load=f"{ck}/{SEGMENTS[-1][0]}")["records"], "end": end}
    finally:
        torch.set_num_threads(threads)


def _within(got: list[dict], want: list[tuple[int, float, float]], tag: str) -> None:
    rows = _rows(got)
    assert [r[0] for r in rows] == list(range(rows[0][0], rows[0][0] + STEP)), tag
    for it, loss, norm in rows:
        _, ref_loss, ref_norm = want[it - 1]
        for what, a, b in (("loss", loss, ref_loss), ("grad_norm", norm, ref_norm)):
            assert abs(a - b) <= TOL * abs(b), f"{tag} iteration {it} {what}: {a} vs one process {b}"


def test_interleaved_and_a2a_resumes_continue_the_one_process_run(runs):
    for rank, per_rank in enumerate(runs["ranks"]):
        for name, _ in SEGMENTS:
            _within(per_rank[name]["records"], runs["serial"], f"rank {rank} {name}")
    _within(runs["resumed"], runs["serial"], "cp2.a2a -> one process")
    assert runs["resumed"][-1]["iteration"] == runs["end"]


def test_interleaved_resume_at_the_same_layout_is_bitwise(runs):
    for rank, per_rank in enumerate(runs["ranks"]):
        resumed, straight = per_rank[SAME], per_rank["straight"]
        assert _rows(resumed["records"]) == _rows(straight["records"][STEP:]), rank
        assert resumed["params"].keys() == straight["params"].keys(), rank
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), (rank, name)


def test_round_trips_keep_weights_master_and_momentum_bitwise(runs):
    ck = runs["ck"]
    for name, (origin, _) in ROUND_TRIPS.items():
        want = {k: v for k, v in full_contents(f"{ck}/{origin}").items() if k.startswith(("model/", "optim/"))}
        assert any(k.endswith("/exp_avg") and v.abs().sum() > 0 for k, v in want.items()), origin
        got = full_contents(f"{ck}/{name}")
        assert got.keys() >= want.keys(), name
        for key, t in want.items():
            assert torch.equal(got[key], t), f"{name}: {key}"


def test_each_checkpoint_records_the_layout_that_saved_it(runs):
    for name, layout in SEGMENTS:
        p = cfg(STEP, **layout).parallel
        got = full_contents(f"{runs['ck']}/{name}")["layout"]
        assert {k: got[k] for k in ("tp", "pp", "cp", "zero")} == dict(tp=p.tp, pp=p.pp, cp=p.context_parallel_size,
                                                                       zero=p.zero), name
