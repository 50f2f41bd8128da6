"""The planner's count of Muon's gathers (``memory/muon_traffic.py``, docs/optimizers.md's formula from the config
alone) equals the bytes the ledger counts at the collectives, every step, on every rank.

One spawned world of 4 ranks trains 2 iterations of each of test_muon_layouts' layouts below (pipeline 1F1B with
tied embeddings and interleaved, CP a2a, ZeRO 3 under tp 2 with SP, MoE at ep 2, tp 2 x ep 2 with a shared expert,
gpt2 MoE at pp 2 x ep 2); each rank's ``send.muon`` bytes of each step equal
``muon_step_bytes(cfg, plan, its pipeline stage, its rank)``. The dp 2 and tp 2 layouts are checked the same way in
test_muon_parity.py.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from megazero.config import Config
from megazero.memory.muon_traffic import muon_step_bytes
from megazero.optimizer.muon import Matrix, take_matrix
from megazero.optimizer.muon_routes import WeightGeometry, gather_routes, scatter_routes
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import state_for
from tests.helpers.optimizer_harness import train
from tests.helpers.muon_runs import dense, moe, muon_bytes
from tests.helpers.tiny_config import degrees

WORLD, ITERS = 4, 2
RUNS = [  # (key, config), each at WORLD ranks (dp fills what the named degrees leave): test_muon_layouts' layouts
    ("gpt2.pp2.1f1b.tied.z1", dense("gpt2", ITERS, **degrees(pp=2, schedule="1f1b", zero=1))),
    ("llama.pp2.interleaved.vp2.z0", dense(iters=ITERS, num_layers=4,
                                           **degrees(pp=2, schedule="interleaved", vp=2, zero=0))),
    ("llama.cp2.a2a.z2", dense(iters=ITERS, seq_length=32, **degrees(cp=2, comm="a2a", zero=2))),
    ("llama.tp2.sp.dp2.z3", dense(iters=ITERS, **degrees(tp=2, sp=True, zero=3))),
    ("moe.llama.ep2.z2", moe(iters=ITERS, ep=2, zero=2)),
    ("moe.llama.tp2.sp.ep2.etp1.shared.z1", moe(iters=ITERS, tp=2, ep=2, etp=1, zero=1,
                                                model=dict(moe_shared_expert_intermediate_size=32))),
    ("moe.gpt2.pp2.ep2.tied.z1", moe("gpt2", ITERS, pp=2, ep=2, zero=1)),
    # MTP (last stage: its modules and the word embedding's copy): eh_proj and the MTP block's matrices take Muon
    ("llama.mtp.pp2.z1", dense(iters=ITERS, mtp_num_layers=1, **degrees(pp=2, zero=1))),
    ("moe.llama.mtp.pp2.ep2.z2", moe(iters=ITERS, pp=2, ep=2, zero=2, model=dict(mtp_num_layers=1))),
]


def run_many(pstate: ParallelState, runs: list[tuple[str, Config]]) -> dict[str, dict[str, Any]]:
    """Every rank trains every run; per run this rank's pipeline stage and Muon's ledger bytes of each step."""
    states: dict[Any, ParallelState] = {}
    out = {}
    for key, cfg in runs:
        state = state_for(states, cfg, pstate.layout.world_size)
        result = train(state, cfg)
        out[key] = {"pp_rank": result["pp_rank"],
                    "muon_bytes": [muon_bytes(r) for r in result["records"]]}
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, dict[str, Any]]]:
    return spawn(run_many, WORLD, RUNS)


def test_planned_muon_traffic_is_what_the_collectives_move(world):
    bad = []
    for key, cfg in RUNS:
        plan = RunPlan.resolve(cfg, WORLD)
        for rank, per_run in enumerate(world):
            got = per_run[key]
            planned = muon_step_bytes(cfg, plan, got["pp_rank"], rank)
            if not (planned > 0 and got["muon_bytes"] == [planned] * ITERS):
                bad.append(f"{key} rank {rank}: planned {planned}, counted {got['muon_bytes']}")
    assert not bad, "\n".join(bad)


# The routes alone (one process, no collective): each matrix's direction elements reach its owner exactly once
# and the owner's output elements reach every rank holding them exactly once, checked against ``take_matrix`` on
# whole tensors of element ids (an independent assembly: no routes involved).
GEOMETRY = [  # (full shape, split dim, matrices)
    ((16, 5), 0, (Matrix("q", ((0, 4), (8, 12))), Matrix("k", ((4, 6), (12, 14))), Matrix("v", ((6, 8), (14, 16))))),
    ((6, 8), 1, (Matrix("o", ((0, 6),)),)),
    ((3, 4), None, (Matrix("a", ((0, 3),)),)),
    ((2, 4, 6), 2, (Matrix("e0", ((0, 4),), expert=0), Matrix("e1", ((0, 4),), expert=1))),
    ((2, 6, 3), 1, (Matrix("f0", ((0, 6),), expert=0), Matrix("f1", ((0, 6),), expert=1))),
]


def _pieces(full: torch.Tensor, dim: int | None, tp: int) -> list[torch.Tensor]:
    """Each TP rank's flat piece of a full tensor (an unsplit one: the whole on each)."""
    if dim is None:
        return [full.reshape(-1)] * tp
    return [p.reshape(-1) for p in full.chunk(tp, dim=dim)]


@pytest.mark.parametrize("reduction,shards", [(2, 2), (3, 3), (3, 1)])
def test_routes_deliver_each_element_once_where_it_is_needed(reduction, shards):
    tp, ids, weights, offset = 2, [], [], 0
    for full_shape, dim, matrices in GEOMETRY:
        first = sum(len(w.matrices) for w in weights)
        ids.append(torch.arange(offset * 10, offset * 10 + torch.Size(full_shape).numel(), dtype=torch.float64)
                   .view(full_shape) + 1)
        weights.append(WeightGeometry(offset, full_shape, dim, matrices, first))
        offset += ids[-1].numel() // (1 if dim is None else tp)
    numel = -(-offset // (shards * 4)) * shards * 4
    shard = numel // shards
    buckets = [torch.zeros(numel, dtype=torch.float64) for _ in range(tp)]  # TP rank t's bucket
    for w, full in zip(weights, ids):
        for t, piece in enumerate(_pieces(full, w.split_dim, tp)):
            buckets[t][w.offset:w.offset + piece.numel()] = piece
    ranks = reduction * tp
    held = [buckets[r % tp] if shards == 1 else buckets[r % tp][(r // tp) * shard:(r // tp + 1) * shard]
            for r in range(ranks)]
    owners = [k % ranks for k in range(sum(len(w.matrices) for w in weights))][::-1]
    # gather: each owner joins what it receives and finds its matrices as take_matrix finds them in the ids
    got: dict[tuple[int, int, int], torch.Tensor] = {}
    for (src, dst), pieces in gather_routes(weights, numel, owners, reduction, tp, shards).items():
        base = 0 if shards == 1 else (src // tp) * shard
        for wi, k, t, lo, hi in pieces:
            assert owners[k] == dst and (src % tp == t or weights[wi].split_dim is None)
            w = weights[wi]
            local = got.setdefault((dst, wi, t), torch.full((ids[wi].numel() // (1 if w.split_dim is None else tp),),
                                                            float("nan"), dtype=torch.float64))
            assert torch.isnan(local[lo:hi]).all(), "an element arrived twice"
            local[lo:hi] = held[src][w.offset + lo - base:w.offset + hi - base]
    for wi, w in enumerate(weights):
        for j, m in enumerate(w.matrices):
            o = owners[w.first + j]
            parts = [got[(o, wi, t)] for t in (range(tp) if w.split_dim is not None else [o % tp])]
            full = parts[0].view(ids[wi].shape) if w.split_dim is None else torch.cat(
                [p.view(ids[wi].chunk(tp, dim=w.split_dim)[0].shape) for p in parts], dim=w.split_dim)
            assert torch.equal(take_matrix(full, m), take_matrix(ids[wi], m)), (wi, m.label)
    # scatter: every rank ends with each Muon element of what it holds, once
    recv = [torch.full_like(h, float("nan")) for h in held]
    for (src, dst), pieces in scatter_routes(weights, numel, owners, reduction, tp, shards).items():
        base = 0 if shards == 1 else (dst // tp) * shard
        for wi, k, t, lo, hi in pieces:
            w = weights[wi]
            assert owners[k] == src and dst % tp == t
            part = recv[dst][w.offset + lo - base:w.offset + hi - base]
            assert torch.isnan(part).all(), "an element arrived twice"
            part.copy_(_pieces(ids[wi], w.split_dim, tp)[t][lo:hi])
    for r in range(ranks):
        filled = ~torch.isnan(recv[r])
        assert torch.equal(recv[r][filled], held[r][filled]) and torch.equal(filled, held[r] != 0), r
