"""``--optimizer muon`` over pipeline, context, expert and 3D parallelism trains what one process trains (issue 42,
"Parity"; ``megazero/optimizer/muon_shards.py``).

One spawned world of 4 ranks trains every layout in it (the pieces ``pretrain_gpt.py`` uses,
``optimizer_harness.train``), fp32, 20 iterations each: pp 2 x dp 2 with 1F1B (gpt2: tied embeddings split over the
stages, ZeRO 1), interleaved (2 chunks per rank, ZeRO 0) and GPipe (ZeRO 2); cp 2 x dp 2 with p2p (ZeRO 1) and a2a
(ZeRO 2), cp 4 hybrid (a2a 2 x p2p 2); MoE llama (E 4, each routed expert's matrices separate Muon matrices) at ep
2 x dp 4 (edp 2, ZeRO 2), tp 2 x ep 2 with sequence parallelism at etp 1 (a shared expert, ZeRO 1) and etp 2; pp 2
x ep 2 (gpt2 MoE, tied embeddings, ZeRO 1); ZeRO 3 at tp 2 x dp 2 with sequence parallelism, resharding after
forward and not (--no-reshard-after-forward), and at dp 4 without. A world of 8 ranks trains tp 2 (sequence
parallel) x pp 2 x dp 2 at ZeRO 3 (llama, GQA; 1F1B, 2 micro-batches per rank). pp 2 1F1B, cp 2 a2a, tp 2 x ep 2 at
etp 2 and the 8-rank layout train a second time in the same world, bitwise equal to the first. One process trains 1
micro-batch of 4 samples as it trains 4 of 1 (20 iterations, within 1e-5). Every rank's loss and grad norm of every
iteration within 1e-5 relative of the same config in one process; the NS calls summed over the ranks exactly one
per Muon matrix of the whole model per step; each rank's holders (the ranks its dense and its expert weights are
owned over) dp x cp x tp and edp x etp of its stage; the bytes of Muon's gathers and scatters counted at the
collectives equal the documented formula every step."""
from __future__ import annotations

from typing import Any

import pytest

from megazero.config import Config
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.optimizer.muon import matrices_of, split_parameters
from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import layout_of, serial_records, state_for
from tests.helpers.muon_runs import dense, moe, muon_bytes, records
from tests.helpers.optimizer_harness import train
from tests.helpers.tiny_config import degrees

ITERS, WORLD, TOL = 20, 4, 1e-5
SHARED = dict(moe_shared_expert_intermediate_size=32)  # a dense expert beside the routed ones

RUNS = [  # (key, config), each at WORLD ranks (dp fills what the named degrees leave); one layout's runs together
    ("gpt2.pp2.1f1b.tied.z1", dense("gpt2", **degrees(pp=2, schedule="1f1b", zero=1))),
    ("llama.pp2.interleaved.vp2.z0", dense(num_layers=4, **degrees(pp=2, schedule="interleaved", vp=2, zero=0))),
    ("llama.pp2.gpipe.z2", dense(**degrees(pp=2, schedule="gpipe", zero=2))),
    ("llama.cp2.p2p.z1", dense(seq_length=32, **degrees(cp=2, comm="p2p", zero=1))),
    ("llama.cp2.a2a.z2", dense(seq_length=32, **degrees(cp=2, comm="a2a", zero=2))),
    ("llama.cp4.hybrid.z1", dense(seq_length=32, **degrees(cp=4, comm="a2a+p2p", a2a=2, zero=1))),
    ("moe.llama.ep2.z2", moe(ep=2, zero=2)),
    ("moe.llama.tp2.sp.ep2.etp1.shared.z1", moe(tp=2, ep=2, etp=1, zero=1, model=SHARED)),
    ("moe.llama.tp2.sp.ep2.etp2.z0", moe(tp=2, ep=2, zero=0)),
    ("moe.gpt2.pp2.ep2.tied.z1", moe("gpt2", pp=2, ep=2, zero=1)),
    ("llama.tp2.sp.dp2.z3", dense(**degrees(tp=2, sp=True, zero=3))),  # ZeRO 3: params sharded like the grads
    ("llama.tp2.sp.dp2.z3.no_reshard", dense(reshard_after_forward=False, **degrees(tp=2, sp=True, zero=3))),
    ("llama.dp4.z3.no_reshard", dense(reshard_after_forward=False, **degrees(zero=3))),
]
RUNS_8 = [("llama.tp2.sp.pp2.dp2.z3", dense(**degrees(tp=2, sp=True, pp=2, zero=3)))]
RERUN = {"gpt2.pp2.1f1b.tied.z1", "llama.cp2.a2a.z2", "moe.llama.tp2.sp.ep2.etp2.z0",  # trained twice: bitwise
         "llama.tp2.sp.pp2.dp2.z3"}


def run_many(pstate: ParallelState, runs: list[tuple[str, Config]]) -> dict[str, dict[str, Any]]:
    """Every rank trains every run (twice if in RERUN), building each new layout's groups collectively; per run
    the records (of each training), this rank's NS calls, the size of its holder sets (dense, expert), and Muon's
    ledger bytes against the formula (of the first training)."""
    states: dict[Any, ParallelState] = {}
    out = {}
    for key, cfg in runs:
        state = state_for(states, cfg, pstate.layout.world_size)
        trained = []
        for _ in range(2 if key in RERUN else 1):
            seen: list[Any] = []
            trained.append((train(state, cfg, hook=lambda model, _: seen.append(model.optimizer.muon)), seen[0]))
        (result, muon), again = trained[0], [records(r) for r, _ in trained[1:]]
        out[key] = {"records": records(result), "again": again, "ns_calls": muon.ns_calls,
                    "holders": {expert: h.ranks for expert, h in muon.holders.items()},
                    "muon_bytes": [muon_bytes(r) for r in result["records"]], "formula": muon.step_bytes()}
    return out


def serial_references(runs: list[tuple[str, Config]]) -> dict[str, list[tuple[float, float]]]:
    """Each run's one-process records, on one thread as every spawned rank runs (``moe_runs.serial_records``: once
    per session per config, shared with every file that asks it for the same one-process config)."""
    return dict(zip([key for key, _ in runs], serial_records([cfg for _, cfg in runs])))


def mismatches(got: list[tuple[float, float]], want: list[tuple[float, float]], tag: str,
               worst: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Every loss and grad norm of ``got`` further than TOL (relative) from ``want``; ``worst`` keeps the largest."""
    assert len(got) == len(want) == ITERS, tag
    bad = {}
    for it, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        for what, value, ref in (("loss", loss, ref_loss), ("grad_norm", norm, ref_norm)):
            err = abs(value - ref) / abs(ref)
            worst[tag] = max(worst.get(tag, 0.0), err)
            if not err <= TOL:
                bad[f"{tag}.{what}[{it}]"] = (value, ref)
    return bad


def check_parity(world: list[dict[str, dict[str, Any]]], runs: list[tuple[str, Config]]) -> None:
    """Every rank's records within TOL of one process; a rerun's records == the first training's."""
    serial = serial_references(runs)
    bad, worst = {}, {}
    for rank, per_run in enumerate(world):
        for key, run in per_run.items():
            bad.update(mismatches(run["records"], serial[key], f"rank{rank}.{key}", worst))
            for again in run["again"]:
                assert again == run["records"], f"rank{rank}.{key}: the rerun is not bitwise the first training"
    assert {key for key, run in world[0].items() if run["again"]} == RERUN & {key for key, _ in runs}
    print("max relative error:", {k: f"{v:.1e}" for k, v in worst.items() if k.startswith("rank0.")})
    assert not bad, f"{len(bad)} mismatches, e.g. {dict(list(bad.items())[:8])}"


def model_matrices(cfg: Config) -> int:
    """The Muon matrices of the whole (one-process) model: the NS calls one step makes over every rank."""
    model = GPTModel(cfg.model, TPContext(group=None))
    muon_named, _ = split_parameters(model.named_parameters())
    return sum(len(matrices_of(n, p.shape, cfg.model)) for n, p in muon_named)


def check_ns_calls_and_holders(world: list[dict[str, dict[str, Any]]], runs: list[tuple[str, Config]]) -> None:
    """One NS call per Muon matrix per step over all ranks, some on each rank; holders dp x cp x tp, edp x etp."""
    for key, cfg in runs:
        calls = [per_run[key]["ns_calls"] for per_run in world]
        assert sum(calls) == ITERS * model_matrices(cfg), (key, calls, model_matrices(cfg))
        assert all(c > 0 for c in calls), (key, calls)  # shared, not all on a few ranks
        layout = layout_of(cfg, len(world))
        want = {False: layout.dp * layout.cp * layout.tp}
        if cfg.model.num_experts is not None:
            want[True] = layout.expert.edp * layout.expert.etp
        assert all(per_run[key]["holders"] == want for per_run in world), (key, want)


def check_bytes(world: list[dict[str, dict[str, Any]]]) -> None:
    """The ledger's send.muon bytes of every step equal docs/optimizers.md's formula (``step_bytes``)."""
    for rank, per_run in enumerate(world):
        for key, run in per_run.items():
            assert run["formula"] > 0 and run["muon_bytes"] == [run["formula"]] * ITERS, (rank, key, run["formula"],
                                                                                          run["muon_bytes"][:3])


@pytest.fixture(scope="module")
def world() -> list[dict[str, dict[str, Any]]]:
    return spawn(run_many, WORLD, RUNS)


def test_muon_layouts_train_what_one_process_trains(world):
    check_parity(world, RUNS)


def test_each_matrix_is_orthogonalised_once_per_step_over_its_holders(world):
    check_ns_calls_and_holders(world, RUNS)


def test_the_gathers_muon_adds_move_the_documented_bytes(world):
    check_bytes(world)


def test_tp2_pp2_dp2_zero3_on_8_ranks_trains_what_one_process_trains():
    """The issue's 8-rank layout: every check above, in one test (one 8-rank world, not one per test)."""
    world8 = spawn(run_many, 8, RUNS_8)
    check_parity(world8, RUNS_8)
    check_ns_calls_and_holders(world8, RUNS_8)
    check_bytes(world8)


def test_one_micro_batch_of_four_trains_as_four_of_one():
    """The same global batch of 4 in one process: micro-batch size 4 once, and micro-batch size 1 four times."""
    one, four = (serial_references([("mbs", dense(micro_batch_size=mbs, global_batch_size=4))])["mbs"]
                 for mbs in (4, 1))
    worst: dict[str, float] = {}
    bad = mismatches(four, one, "4 x 1 vs 1 x 4", worst)
    print("max relative error:", worst)
    assert not bad, bad
