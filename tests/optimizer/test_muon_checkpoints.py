"""A Muon checkpoint resumes at another layout and continues the run one process trains (issue 42, "Checkpoints").

Muon's momentum lives in the ZeRO store's ``exp_avg`` (``megazero/optimizer/muon_shards.py``), so a checkpoint stores
it by full shape like AdamW's first moment, and the resharding loader places it at any valid layout. One spawned world
of 2 ranks walks three chains, each segment training 2 iterations from the previous segment's checkpoint and saving
its own (``tests/helpers/resume.py``'s ``segment``); this process then resumes each chain's last checkpoint:

- llama (GQA, Muon lr 0.02, AdamW lr 1e-3 for the rest): dp 2 ZeRO 1 -> dp 2 ZeRO 1 -> tp 2 (SP) -> dp 2 ZeRO 2
  -> dp 2 ZeRO 3 -> pp 2 -> dp 2 ZeRO 0 -> cp 2 (ZeRO 1) -> dp 2 ZeRO 2 -> one process;
- the llama as a MoE model (E 4, top 2): ep 2 (ZeRO 1) -> ep 1 x dp 2 (ZeRO 2) -> ep 2 (ZeRO 0) -> one process;
- gpt2 (tied embeddings): one process -> pp 2 (ZeRO 1) -> tp 2 (SP, ZeRO 2) -> dp 2 (ZeRO 0) -> one process.

Every resumed segment's loss and grad norm per iteration lie within 1e-5 relative of the uninterrupted one-process
run; the same-layout resume repeats the uninterrupted dp 2 ZeRO 1 run bitwise (records and weights). ROUND_TRIPS
load a chain's checkpoint and save it again at once at another layout: dp 2 ZeRO 1 at tp 2, pp 2, cp 2, dp 2 ZeRO 3
and ZeRO 3 with the state in host memory (--offload-optimizer cpu); the ZeRO 3 one at ZeRO 1; the MoE ep 1 one at
ep 2 and the ep 2 one at ep 1 (ZeRO 3). Each holds bitwise the loaded checkpoint's full-shape weights, master and
momentum (the experts' too; read from the files). One matrix's saved momentum equals the one-process checkpoint's
at that iteration. That is 24 save/load pairs: 16 resumes (15 segments that load, 3 chains' one-process ends;
within 1e-5, one bitwise) and 8 bitwise round trips.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from megazero.parallel.state import ParallelState
from tests.helpers.compare import rel_err
from tests.helpers.dist import spawn
from tests.helpers.moe_ckpt import full_contents, round_trip
from tests.helpers.moe_runs import layout_of
from tests.helpers.optimizer_harness import make_cfg
from tests.helpers.resume import segment
from tests.helpers.tiny_config import family

WORLD, STEP, TOL = 2, 2, 1e-5
MUON = dict(optimizer="muon", lr=0.02, muon_adam_lr=1e-3)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
# a chain: the model (arch, MoE?) and its segments (name, layout), each loading the previous one's checkpoint; the
# first starts fresh, or (FROM_ONE_PROCESS) from a checkpoint one process saved at iteration STEP
CHAINS: dict[str, tuple[str, bool, list[tuple[str, dict]]]] = {
    "dense": ("llama", False, [
        ("dp2.z1", dict(zero=1)), ("dp2.z1.same", dict(zero=1)), ("tp2.sp", dict(tp=2, sp=True)),
        ("dp2.z2", dict(zero=2)), ("dp2.z3", dict(zero=3)), ("pp2", dict(pp=2)), ("dp2.z0", dict(zero=0)),
        ("cp2.z1", dict(context_parallel_size=2, zero=1)), ("dp2.z2.last", dict(zero=2))]),
    "moe": ("llama", True, [
        ("ep2.z1", dict(expert_model_parallel_size=2, zero=1)), ("ep1.dp2.z2", dict(zero=2)),
        ("ep2.z0", dict(expert_model_parallel_size=2, zero=0))]),
    "gpt2": ("gpt2", False, [  # tied embeddings: split over the stages at pp 2
        ("gpt2.pp2.z1", dict(pp=2, zero=1)), ("gpt2.tp2.sp.z2", dict(tp=2, sp=True, zero=2)),
        ("gpt2.dp2.z0", dict(zero=0))]),
}
FROM_ONE_PROCESS = {"gpt2"}
# a round trip: the checkpoint it loads (a chain segment's), the model (MoE?) and the layout that saves it again at once
ROUND_TRIPS: dict[str, tuple[str, bool, dict]] = {
    "dp2.z1.to.tp2": ("dp2.z1", False, dict(tp=2, sp=True)), "dp2.z1.to.pp2": ("dp2.z1", False, dict(pp=2)),
    "dp2.z1.to.cp2": ("dp2.z1", False, dict(context_parallel_size=2, zero=2)),
    "dp2.z1.to.z3": ("dp2.z1", False, dict(zero=3)),
    "dp2.z1.to.z3.cpu": ("dp2.z1", False, dict(zero=3, offload_optimizer="cpu")),  # the state in host memory
    "dp2.z3.to.z1": ("dp2.z3", False, dict(zero=1)),  # the chain's ZeRO 3 save, trained at ZeRO 3
    "moe.ep1.to.ep2": ("ep1.dp2.z2", True, dict(expert_model_parallel_size=2, zero=1)),
    "moe.ep2.to.ep1": ("ep2.z1", True, dict(zero=3)),
}
SAME = "dp2.z1.same"  # resumed at the layout that saved it
MATRIX = "layers.0.mlp.fc1.weight"  # a Muon matrix (the llama MLP's up projection)


def cfg(iters: int, arch: str = "llama", moe: bool = False, **layout: Any):
    """The tiny model (llama: GQA) trained by Muon to iteration ``iters`` at ``layout`` (a MoE model if ``moe``)."""
    return make_cfg(iters=iters, seq_length=16, **family(arch), **MUON, **(MOE if moe else {}), **layout)


def _state(pstate: ParallelState, c, states: dict) -> ParallelState:
    key = layout_of(c, pstate.layout.world_size)
    if key not in states:  # each layout's groups built once (collectively: every rank walks the same layouts)
        states[key] = ParallelState.build(key, "cpu")
    return states[key]


def chain(pstate: ParallelState, ck: str, kind: str, states: dict) -> dict[str, dict]:
    """Train the chain's segments in turn, each from the previous one's checkpoint; the records of each (and the
    final weights of the same-layout resume)."""
    arch, moe, segments = CHAINS[kind]
    out, source = {}, (f"{ck}/{kind}.one.process" if kind in FROM_ONE_PROCESS else None)
    for i, (name, layout) in enumerate(segments, start=1 + (kind in FROM_ONE_PROCESS)):
        c = cfg(STEP * i, arch, moe, **layout)
        result = segment(_state(pstate, c, states), c, load=source, save=f"{ck}/{name}")
        out[name] = {"records": result["records"], **({"params": result["params"]} if name == SAME else {})}
        source = f"{ck}/{name}"
    return out


def world(pstate: ParallelState, ck: str) -> dict[str, Any]:
    states: dict = {}
    out: dict[str, Any] = {kind: chain(pstate, ck, kind, states) for kind in CHAINS}
    out["straight"] = segment(pstate, cfg(2 * STEP, zero=1))  # the dp 2 ZeRO 1 run that never stopped
    for name, (origin, moe, layout) in ROUND_TRIPS.items():
        c = cfg(STEP, moe=moe, **layout)
        round_trip(_state(pstate, c, states), c, f"{ck}/{origin}", f"{ck}/{name}")
    return out


def _rows(records: list[dict]) -> list[tuple[int, float, float]]:
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in records]


def _end(kind: str) -> int:
    """The chain's last iteration, after its one-process segment."""
    return STEP * (len(CHAINS[kind][2]) + 1 + (kind in FROM_ONE_PROCESS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    ck = str(tmp_path_factory.mktemp("muon_ckpt"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every spawned rank runs
    try:
        serial = ParallelState.serial()
        for kind in FROM_ONE_PROCESS:
            segment(serial, cfg(STEP, CHAINS[kind][0], CHAINS[kind][1]), save=f"{ck}/{kind}.one.process")
        segment(serial, cfg(STEP), save=f"{ck}/serial.z0")  # the one-process checkpoint at dp2.z1's iteration
        out = {"ck": ck, "ranks": spawn(world, WORLD, ck), "serial": {}, "resumed": {}}
        for kind, (arch, moe, segments) in CHAINS.items():
            out["serial"][kind] = _rows(segment(serial, cfg(_end(kind), arch, moe))["records"])  # never stopped
            out["resumed"][kind] = segment(serial, cfg(_end(kind), arch, moe),
                                           load=f"{ck}/{segments[-1][0]}")["records"]
        return out
    finally:
        torch.set_num_threads(threads)


def _within(got: list[dict], want: list[tuple[int, float, float]], tag: str) -> float:
    rows = _rows(got)
    first = rows[0][0]
    assert [r[0] for r in rows] == list(range(first, first + STEP)), tag
    worst = 0.0
    for it, loss, norm in rows:
        _, ref_loss, ref_norm = want[it - 1]
        for what, a, b in (("loss", loss, ref_loss), ("grad_norm", norm, ref_norm)):
            err = abs(a - b) / abs(b)
            assert err <= TOL, f"{tag} iteration {it} {what}: {a} vs one process {b} ({err:.1e})"
            worst = max(worst, err)
    return worst


def test_each_resume_at_another_layout_continues_the_one_process_run(runs):
    worst = {}
    for kind in CHAINS:
        serial = runs["serial"][kind]
        for rank, per_rank in enumerate(runs["ranks"]):
            assert per_rank[kind].keys() == {name for name, _ in CHAINS[kind][2]}, rank
            for name, run in per_rank[kind].items():
                worst[name] = max(worst.get(name, 0.0), _within(run["records"], serial, f"rank {rank} {name}"))
        worst[f"{kind}.to.one.process"] = _within(runs["resumed"][kind], serial, f"{kind} -> one process")
        assert runs["resumed"][kind][-1]["iteration"] == _end(kind)
    print("max relative error per resumed segment:", {k: f"{v:.1e}" for k, v in worst.items()})


def test_resume_at_the_same_layout_is_bitwise(runs):
    for rank, per_rank in enumerate(runs["ranks"]):
        resumed, straight = per_rank["dense"][SAME], per_rank["straight"]
        assert _rows(resumed["records"]) == _rows(straight["records"][STEP:]), rank
        assert resumed["params"].keys() == straight["params"].keys(), rank
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), (rank, name)


def test_each_checkpoint_records_the_layout_that_saved_it(runs):
    """The chains really changed layout: each checkpoint's recorded degrees are its segment's (the MoE ones hold
    experts, saved by global id)."""
    for arch, moe, segments in CHAINS.values():
        for name, layout in segments:
            c = cfg(STEP, arch, moe, **layout)
            p = c.parallel
            got = full_contents(f"{runs['ck']}/{name}")
            want = dict(tp=p.tp, pp=p.pp, cp=p.context_parallel_size, ep=p.ep, zero=p.zero)
            assert {k: got["layout"][k] for k in want} == want, name
            assert any(".experts." in k for k in got) == moe, name


def _saved(contents: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in contents.items() if k.startswith(("model/", "optim/"))}


def test_momentum_is_saved_by_full_shape_whatever_the_layout(runs):
    ck = runs["ck"]
    origin = full_contents(f"{ck}/dp2.z1")
    momentum = origin[f"optim/{MATRIX}/exp_avg"]
    assert momentum.shape == origin[f"model/{MATRIX}"].shape and not momentum.isnan().any()
    assert momentum.abs().sum() > 0 and origin[f"optim/{MATRIX}/exp_avg_sq"].abs().sum() == 0  # Muon's, not Adam's
    serial = full_contents(f"{ck}/serial.z0")
    assert rel_err(momentum, serial[f"optim/{MATRIX}/exp_avg"]) < TOL  # trained at dp 2 vs in one process


def test_round_trips_keep_weights_master_and_momentum_bitwise(runs):
    """Loaded and saved again at once at another layout (tp, pp, cp, ZeRO 1 <-> 3, the state on the host, ep 1 <->
    2), the files hold the loaded checkpoint's tensors bit for bit; the MoE ones the experts' momentum too."""
    ck = runs["ck"]
    for name, (origin, moe, layout) in ROUND_TRIPS.items():
        want = _saved(full_contents(f"{ck}/{origin}"))
        momenta = [k for k, v in want.items() if k.endswith("/exp_avg") and v.abs().sum() > 0]
        assert momenta and any(".experts." in k for k in momenta) == moe, origin
        got = full_contents(f"{ck}/{name}")
        p = cfg(STEP, moe=moe, **layout).parallel
        assert {k: got["layout"][k] for k in ("tp", "pp", "cp", "ep", "zero")} == dict(
            tp=p.tp, pp=p.pp, cp=p.context_parallel_size, ep=p.ep, zero=p.zero), name
        tensors = _saved(got)
        assert tensors.keys() == want.keys(), name
        for key, t in want.items():
            assert not t.isnan().any() and torch.equal(tensors[key], t), f"{name}: {key}"
