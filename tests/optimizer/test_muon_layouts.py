"""``--optimizer muon`` over pipeline, context and expert parallelism trains what one process trains (issue 42,
"Distribution"; ``megazero/optimizer/muon_shards.py``).

One spawned world of 4 ranks trains every layout in it (the pieces ``pretrain_gpt.py`` uses,
``optimizer_harness.train``), fp32, 10 iterations each: pp 2 x dp 2 with 1F1B (gpt2: tied embeddings split over
the stages, ZeRO 1) and interleaved (2 chunks per rank, ZeRO 0); cp 2 x dp 2 with p2p (ZeRO 1) and a2a (ZeRO 2),
cp 4 hybrid (a2a 2 x p2p 2); MoE llama (E 4, each routed expert's matrices separate Muon matrices) at ep 2 x dp 4
(edp 2, ZeRO 2), tp 2 x ep 2 with sequence parallelism at etp 1 (a shared expert, ZeRO 1) and etp 2; pp 2 x ep 2
(gpt2 MoE, tied embeddings, ZeRO 1); ZeRO 3 at tp 2 x dp 2 with sequence parallelism (reshard after forward) and
at dp 4 (--no-reshard-after-forward).
Every rank's loss and grad norm of every iteration within 1e-5 relative of the same config in one process; the
NS calls summed over the ranks exactly one per Muon matrix of the whole model per step; each rank's holders (the
ranks its dense and its expert weights are owned over) dp x cp x tp and edp x etp of its stage; the bytes of
Muon's gathers and scatters counted at the collectives equal the documented formula every step.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from megazero.config import Config
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.optimizer.muon import matrices_of, split_parameters
from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import layout_of, make_cfg, serial_config, state_for
from tests.helpers.muon_runs import muon_bytes
from tests.helpers.optimizer_harness import train
from tests.helpers.session_cache import cached
from tests.helpers.tiny_config import degrees, family, tiny_config

ITERS, WORLD, TOL = 10, 4, 1e-5
MUON = dict(optimizer="muon", lr=0.02, muon_adam_lr=1e-3)
SHARED = dict(moe_shared_expert_intermediate_size=32)  # a dense expert beside the routed ones


def dense(arch: str = "llama", **flat: Any) -> Config:
    """The tiny dense config trained by Muon (lr 0.02) with AdamW (lr 1e-3) for the rest."""
    return tiny_config(**family(arch), **{**MUON, "train_iters": ITERS, **flat})


def moe(arch: str = "llama", **kw: Any) -> Config:
    """``moe_runs.make_cfg``'s tiny MoE (E 4, k 2, aux and z losses) trained by Muon."""
    return make_cfg(arch, iters=ITERS, training={**MUON, **kw.pop("training", {})}, **kw)


RUNS = [  # (key, config), each at WORLD ranks (dp fills what the named degrees leave)
    ("gpt2.pp2.1f1b.tied.z1", dense("gpt2", **degrees(pp=2, schedule="1f1b", zero=1))),
    ("llama.pp2.interleaved.vp2.z0", dense(num_layers=4, **degrees(pp=2, schedule="interleaved", vp=2, zero=0))),
    ("llama.cp2.p2p.z1", dense(seq_length=32, **degrees(cp=2, comm="p2p", zero=1))),
    ("llama.cp2.a2a.z2", dense(seq_length=32, **degrees(cp=2, comm="a2a", zero=2))),
    ("llama.cp4.hybrid.z1", dense(seq_length=32, **degrees(cp=4, comm="a2a+p2p", a2a=2, zero=1))),
    ("moe.llama.ep2.z2", moe(ep=2, zero=2)),
    ("moe.llama.tp2.sp.ep2.etp1.shared.z1", moe(tp=2, ep=2, etp=1, zero=1, model=SHARED)),
    ("moe.llama.tp2.sp.ep2.etp2.z0", moe(tp=2, ep=2, zero=0)),
    ("moe.gpt2.pp2.ep2.tied.z1", moe("gpt2", pp=2, ep=2, zero=1)),
    ("llama.tp2.sp.dp2.z3", dense(**degrees(tp=2, sp=True, zero=3))),  # ZeRO 3: params sharded like the grads
    ("llama.dp4.z3.no_reshard", dense(reshard_after_forward=False, **degrees(zero=3))),
]


def records(result: dict[str, Any]) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in result["records"]]


def run_many(pstate: ParallelState, runs: list[tuple[str, Config]]) -> dict[str, dict[str, Any]]:
    """Every rank trains every run, building each new layout's groups collectively; per run the records, this
    rank's NS calls, the size of its holder sets (dense, expert), and Muon's ledger bytes against the formula."""
    states: dict[Any, ParallelState] = {}
    out = {}
    for key, cfg in runs:
        state = state_for(states, cfg, pstate.layout.world_size)
        seen: list[Any] = []
        result = train(state, cfg, hook=lambda model, _: seen.append(model.optimizer.muon))
        muon = seen[0]
        out[key] = {"records": records(result), "ns_calls": muon.ns_calls,
                    "holders": {expert: h.ranks for expert, h in muon.holders.items()},
                    "muon_bytes": [muon_bytes(r) for r in result["records"]],
                    "formula": muon.step_bytes()}
    return out


def _serial_records(cfg: Config) -> list[tuple[float, float]]:
    return records(train(ParallelState.serial(), cfg))


def model_matrices(cfg: Config) -> int:
    """The Muon matrices of the whole (one-process) model: the NS calls one step makes over every rank."""
    model = GPTModel(cfg.model, TPContext(group=None))
    muon_named, _ = split_parameters(model.named_parameters())
    return sum(len(matrices_of(n, p.shape, cfg.model)) for n, p in muon_named)


@pytest.fixture(scope="module")
def world() -> list[dict[str, dict[str, Any]]]:
    return spawn(run_many, WORLD, RUNS)


def test_muon_layouts_train_what_one_process_trains(world):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every spawned rank runs
    try:
        serial = {key: cached(_serial_records, serial_config(cfg)) for key, cfg in RUNS}
    finally:
        torch.set_num_threads(threads)
    bad, worst = {}, {}
    for rank, per_run in enumerate(world):
        for key, run in per_run.items():
            assert len(run["records"]) == ITERS, key
            for it, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(run["records"], serial[key])):
                for what, got, want in (("loss", loss, ref_loss), ("grad_norm", norm, ref_norm)):
                    err = abs(got - want) / abs(want)
                    worst[key] = max(worst.get(key, 0.0), err)
                    if not err <= TOL:
                        bad[f"rank{rank}.{key}.{what}[{it}]"] = (got, want)
    print("max relative error per layout:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert not bad, f"{len(bad)} mismatches, e.g. {dict(list(bad.items())[:8])}"


def test_each_matrix_is_orthogonalised_once_per_step_over_its_holders(world):
    for key, cfg in RUNS:
        calls = [per_run[key]["ns_calls"] for per_run in world]
        assert sum(calls) == ITERS * model_matrices(cfg), (key, calls, model_matrices(cfg))
        assert all(c > 0 for c in calls), (key, calls)  # shared, not all on a few ranks
        layout = layout_of(cfg, WORLD)
        want = {False: layout.dp * layout.cp * layout.tp}
        if cfg.model.num_experts is not None:
            want[True] = layout.expert.edp * layout.expert.etp
        assert all(per_run[key]["holders"] == want for per_run in world), (key, want)


def test_the_gathers_muon_adds_move_the_documented_bytes(world):
    for rank, per_run in enumerate(world):
        for key, run in per_run.items():
            assert run["formula"] > 0 and run["muon_bytes"] == [run["formula"]] * ITERS, (rank, key, run["formula"],
                                                                                          run["muon_bytes"][:3])
