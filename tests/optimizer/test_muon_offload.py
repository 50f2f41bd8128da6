"""``--optimizer muon`` with its state offloaded (``--offload-optimizer cpu|disk``) trains what one process trains.

One spawned world of 2 ranks (dp 2, fp32, llama with GQA, 20 iterations; the pieces ``pretrain_gpt.py`` uses,
``optimizer_harness.train``): ZeRO 1 on the host, ZeRO 2 on disk with 2 buffers of ``SMALL`` elements (below
the bucket shards, so the shards stream through in pieces and the step sweeps them twice) and ZeRO 3 on disk,
each beside the same layout in memory. On a CPU-only machine host memory is the device, so each offloaded run
must equal its in-memory run bit for bit (losses, grad norms, final weights); every run lies within 1e-5 of
one process; a rerun is bitwise; the NS calls summed over the ranks are one per Muon matrix per step, each rank
making some. Memory: the device holds no optimizer state, the host copy (cpu) and the state file (disk) are
the in-memory store's bytes - one moment for the Muon elements (``kept``) - plus the fp32 master copy an
fp32 run keeps in the parameters when in memory, and the planner's host and disk bytes match them within 2%.
Checkpoints (ZeRO 2): a disk-offloaded run's checkpoint resumes in memory, and an in-memory one on disk and on
the host, each continuing the uninterrupted run bit for bit (records, evaluations, final weights).
"""
from __future__ import annotations

import os
from typing import Any

import pytest

from megazero.config import Config
from megazero.memory import PlanSpec, plan_memory
from megazero.optimizer.accounting import measured_state_bytes
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import serial_records, state_for
from tests.helpers.muon_runs import ITERS, muon_cfg, records
from tests.helpers.offload_runs import differences
from tests.helpers.optimizer_harness import train
from tests.helpers.resume import segment
from tests.helpers.tiny_config import degrees

SMALL = 320  # --offload-buffer-size: below the multi-parameter bucket shards, so those go through in pieces
TOL = 0.02


def offloaded(cfg: Config, where: str, folder: str) -> Config:
    path = {"offload_path": folder, "offload_buffer_size": SMALL} if where == "disk" else {}
    return cfg.updated(offload_optimizer=where, **path)


def runs(folder: str) -> list[tuple[str, Config, Config | None, bool]]:
    """(key, config, its in-memory twin or None, trained twice)."""
    out = []
    for zero, where in ((1, "cpu"), (2, "disk"), (3, "disk")):
        memory = muon_cfg(**degrees(zero=zero))
        out += [(f"z{zero}.none", memory, None, False),
                (f"z{zero}.{where}", offloaded(memory, where, f"{folder}/z{zero}"), memory, zero < 3)]
    return out


def train_one(pstate: ParallelState, cfg: Config) -> dict[str, Any]:
    """Train ``cfg``; its records, weights, NS calls, memory record and disk pieces; then close the optimizer (the
    disk tier must remove its file)."""
    seen: list[Any] = []
    result = train(pstate, cfg, hook=lambda model, _: seen.append(model.optimizer))
    opt = seen[0]
    store = opt.store
    path = getattr(store, "path", None)
    out = {**result, "ns_calls": opt.muon.ns_calls, "matrices": opt.muon.matrices,
           "memory": measured_state_bytes(opt), "buckets": len(opt.bucket_list),
           "shard_elements": sum(b.shard_numel for _, b in opt.bucket_list),
           "pieces": len(store.pieces) if hasattr(store, "pieces") else None}
    opt.close()
    out["files_left"] = path is not None and os.path.exists(path)
    return out


def checkpoints(pstate: ParallelState, folder: str) -> dict[str, dict[str, Any]]:
    """ZeRO 2, 4 iterations straight, and resumed at iteration 2: in memory from a disk-offloaded checkpoint, and
    on disk and on the host from an in-memory one (the saved momentum by full shape, a zero exp_avg_sq for
    Muon's parameters)."""
    cfg = muon_cfg(**degrees(zero=2), train_iters=4, eval_interval=2, eval_iters=1)
    first, ck = cfg.updated(train_iters=2), f"{folder}/ck"
    out = {"straight": segment(pstate, cfg)}
    segment(pstate, offloaded(first, "disk", f"{folder}/ck_state"), save=f"{ck}/disk")
    out["memory<-disk"] = segment(pstate, cfg, load=f"{ck}/disk")
    segment(pstate, first, save=f"{ck}/memory")
    out["disk<-memory"] = segment(pstate, offloaded(cfg, "disk", f"{folder}/ck_state"), load=f"{ck}/memory")
    out["cpu<-memory"] = segment(pstate, offloaded(cfg, "cpu", folder), load=f"{ck}/memory")
    return out


def run_many(pstate: ParallelState, folder: str) -> dict[str, Any]:
    """Every rank trains every run (twice where asked), building each new layout's groups collectively."""
    states: dict[Any, ParallelState] = {}
    out: dict[str, Any] = {}
    for key, cfg, _, rerun in runs(folder):
        state = state_for(states, cfg, pstate.layout.world_size)
        out[key] = [train_one(state, cfg) for _ in range(2 if rerun else 1)]
    out["checkpoints"] = checkpoints(pstate, folder)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[list[dict[str, list[dict[str, Any]]]], str]:
    folder = str(tmp_path_factory.mktemp("muon_offload"))
    return spawn(run_many, 2, folder), folder


def test_offloaded_muon_is_the_in_memory_run_and_one_process(world):
    results, folder = world
    serial = dict(zip([k for k, *_ in runs(folder)], serial_records([c for _, c, *_ in runs(folder)])))
    bad = []
    for rank, per_run in enumerate(results):
        for key, _, twin, _ in runs(folder):
            done = per_run[key]
            assert len(done[0]["records"]) == ITERS, key
            for it, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(records(done[0]), serial[key])):
                if not (abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and abs(norm - ref_norm) <= 1e-5 * ref_norm):
                    bad.append(f"rank{rank}.{key}[{it}]: {(loss, norm)} vs one process {(ref_loss, ref_norm)}")
            if twin is not None:  # host = device here: the offloaded run is the in-memory one, bit for bit
                bad += [f"rank{rank}.{key}: {d}" for d in differences(done[0], per_run[key.split(".")[0] + ".none"][0])]
                assert not done[0]["files_left"], key
            if len(done) > 1:
                bad += [f"rank{rank}.{key} rerun: {d}" for d in differences(done[1], done[0])]
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:6]}"


def test_offloaded_checkpoints_resume_bitwise(world):
    results, _ = world
    for rank, per_run in enumerate(results):
        ck = per_run["checkpoints"]
        straight = ck["straight"]
        tail = {"records": straight["records"][2:], "evals": straight["evals"][1:], "params": straight["params"]}
        assert len(tail["records"]) == 2 and tail["evals"], straight["evals"]
        for name in ("memory<-disk", "disk<-memory", "cpu<-memory"):  # iterations 3 and 4, resumed
            assert not differences(ck[name], tail), (rank, name, differences(ck[name], tail))


def test_each_matrix_is_orthogonalised_once_per_step(world):
    results, folder = world
    for key, *_ in runs(folder):
        done = [per_run[key][0] for per_run in results]
        calls = [d["ns_calls"] for d in done]
        assert sum(calls) == ITERS * done[0]["matrices"] and all(c > 0 for c in calls), (key, calls)


def test_offloaded_state_is_the_one_moment_store_and_the_plan(world):
    results, folder = world
    for key, cfg, twin, _ in runs(folder):
        if twin is None:
            continue
        where = cfg.parallel.offload_optimizer
        stage = plan_memory(PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, 2), device="cpu")).stages[0]
        planned = stage.optimizer_host_bytes if where == "cpu" else stage.optimizer_disk_bytes
        for per_run in results:
            done, memory = per_run[key][0], per_run[key][0]["memory"]
            in_memory = per_run[key.split(".")[0] + ".none"][0]["memory"]["optimizer_bytes"]
            held = memory["optimizer_host_bytes"] if where == "cpu" else memory["optimizer_disk_bytes"]
            master = 4 * done["shard_elements"]  # fp32: in memory the parameters are the master; offloaded, a copy
            assert memory["optimizer_bytes"] == 0 and held == in_memory + master, (key, memory, in_memory)
            assert abs(planned - held) <= TOL * held, (key, planned, held)
            if where == "disk":
                assert done["pieces"] > done["buckets"], (key, done["pieces"], done["buckets"])  # streamed in pieces
