"""The benchmark's own machinery: byte counting agrees with megazero's ledger; the report logic; the
harness runs a bench module (``python -m bench.x``, no sys.path edits) and every bench's results header."""
from __future__ import annotations

import math
import os
import re

import torch

from bench.comm_count import install
from bench.harness import MZ, Entry, launch
from bench.results import results_header
from bench.run import compare, grad_param_bytes, table, verdict
from megazero.parallel import collectives as C
from tests.helpers.dist import spawn


def _count_both(pstate) -> dict:
    """Issue each collective once through megazero's wrappers; both counters see the same calls."""
    counter = install()
    g = pstate.dp_group
    x = torch.ones(1000)
    out = torch.empty(500)
    checks = {}
    for kind, call in (("all_reduce", lambda: C.all_reduce(x, g)),
                       ("reduce_scatter", lambda: C.reduce_scatter_tensor(out, x, g)),
                       ("all_gather", lambda: C.all_gather_into_tensor(x, out, g)),
                       ("broadcast", lambda: C.broadcast(x, 0, g))):
        pstate.ledger.enabled = counter.enabled = True
        call()
        pstate.ledger.enabled = counter.enabled = False
        checks[kind] = (counter.take().get(kind), pstate.ledger.take().get(f"{kind}/dp"))
    peer = 1 - pstate.rank
    ops = [torch.distributed.P2POp(torch.distributed.isend, x, peer),
           torch.distributed.P2POp(torch.distributed.irecv, torch.empty(1000), peer)]
    counter.enabled = True
    for work in torch.distributed.batch_isend_irecv(ops):
        work.wait()
    counter.enabled = False
    checks["send"] = (counter.take().get("send"), 4000)
    return checks


def test_comm_count_matches_megazero_ledger():
    for rank, checks in enumerate(spawn(_count_both, 2)):
        for kind, (counted, ledger) in checks.items():
            assert counted is not None and math.isclose(counted, ledger), (rank, kind, counted, ledger)
        assert checks["all_reduce"][0] == 4000 and checks["reduce_scatter"][0] == 2000, checks


def _fake(megazero: bool, tps: float, state: int, comm: float, peers=(), kinds=None, losses=(1.0, 0.9)) -> dict:
    return {"status": "ok", "megazero": megazero, "ranks": 2, "peer_of": list(peers), "tokens_per_s": tps,
            "tokens_per_cpu_s": tps,
            "peak_rss_bytes": 2 ** 20, "model_state_bytes": state, "comm_bytes_per_step": comm,
            "comm_kinds_rank0": kinds or {"all_reduce": comm}, "losses": list(losses)}


def test_compare_and_table():
    results = {
        "megazero zero 1": _fake(True, 110.0, 50, 104.0, ["torch DDP", "DeepSpeed ZeRO-1"],
                                 {"reduce_scatter": 50.0, "all_gather": 50.0, "all_reduce": 4.0}),
        "torch DDP": _fake(False, 100.0, 70, 100.0),
        "DeepSpeed ZeRO-1": _fake(False, 120.0, 40, 150.0, losses=(1.0, 0.95)),
        "megatron-core TP": {"status": "not installed (megatron.core)"},
    }
    checks = {(c["megazero"], c["peer"]): c for c in compare(results, [1.0, 0.9])}
    ddp, ds = checks[("megazero zero 1", "torch DDP")], checks[("megazero zero 1", "DeepSpeed ZeRO-1")]
    assert math.isclose(ddp["ratio"], 1.1) and ddp["bytes_ok"] is False and ddp["grad_param_bytes_ok"], ddp
    assert "state_ok" not in ddp and ds["state_ok"] is False and math.isclose(ds["ratio"], 110 / 120), ds
    assert grad_param_bytes(results["megazero zero 1"]) == 100.0
    assert results["DeepSpeed ZeRO-1"]["loss_rel_err"] > 0.05 and results["torch DDP"]["loss_rel_err"] == 0
    text = table(results, list(checks.values()))
    assert "1.10 (1.10) vs torch DDP" in text and "not installed (megatron.core)" in text, text
    lines = verdict(list(checks.values())).splitlines()
    assert "- megazero zero 1 vs torch DDP: more bytes (total)" in lines, lines
    assert "- megazero zero 1 vs DeepSpeed ZeRO-1: slower, more model state" in lines, lines


def test_zero3_entries_and_verdict():
    """bench_zero3: every megazero row names peers that exist; state/bytes/speed verdicts per pair."""
    from bench import bench_zero3 as z3

    rows = {e.name: e for e in z3.entries()}
    for e in rows.values():
        assert all(p in rows for p in e.peer_of), (e.name, e.peer_of)
    assert "--no-sync-accum" in rows["FSDP2 reshard=True, 4 micro-batches, no_sync"].args
    assert "--no-reshard" in rows["megazero zero 3 reshard=False"].args
    results = {"megazero zero 3 reshard=True": _fake(True, 90.0, 40, 100.0, ["FSDP2 reshard=True", "DeepSpeed ZeRO-3"],
                                                     {"all_gather": 60.0, "reduce_scatter": 40.0}),
               "FSDP2 reshard=True": _fake(False, 100.0, 40, 120.0, kinds={"all_gather": 80.0}),
               "DeepSpeed ZeRO-3": {"status": "not installed (deepspeed)"}}
    checks = z3.compare(results, [1.0, 0.9])
    lines = z3.verdict(checks)
    assert lines[0].startswith("- megazero zero 3 reshard=True vs FSDP2 reshard=True: 0.90x") and \
        lines[0].endswith("fails: slower"), lines
    assert lines[1] == "- megazero zero 3 reshard=True vs DeepSpeed ZeRO-3: peer not installed (deepspeed)", lines
    text = "\n".join(z3.table(results))
    assert "| megazero zero 3 reshard=True | 90 | 90 | 0.00 | 0.00 | 0.00 | 0.00 | 0.0e+00 |" in text, text


def test_offload_bench_sampler_and_table():
    """bench_offload's RSS sampler sees a touched allocation; its table's drop is against the in-memory row."""
    import time

    from bench.bench_offload import RssSampler, table

    sampler = RssSampler()
    sampler.armed = True
    time.sleep(0.05)
    base = sampler.peak
    block = torch.ones(64 << 20)  # 256 MiB, every page touched
    time.sleep(0.05)
    sampler.close()
    assert sampler.peak - base >= 200 << 20, (base, sampler.peak)
    del block
    row = dict(step_s=1.0, cpu_s_per_step=1.0, losses=[2.0], vm_hwm=5e9)
    text = table([{"row": "none", **row, "peak_step_rss": 3e9, "optimizer_bytes": 1e9, "time_max_rss": 4e9},
                  {"row": "disk", **row, "peak_step_rss": 2.1e9, "time_max_rss": 3.05e9},
                  {"row": "deepspeed-cpu", "error": "no op"}])
    assert "| 3.05 | 90% | 95% |" in text and "failed: no op" in text  # in-step and whole-run (/usr/bin/time)


def test_harness_runs_the_entry_as_a_module_of_the_repository(monkeypatch):
    """The single-process reference, launched as ``python -m bench.megazero_entry`` with no PYTHONPATH."""
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the suite's conftest sets one; a user's shell has none
    record = launch(Entry("serial", MZ, [], 1), ["--steps", "1", "--warmup", "0"], timeout=300)
    assert "error" not in record, record.get("error")
    assert len(record["losses"]) == 1 and math.isfinite(record["losses"][0]), record


def test_results_header_names_bench_date_machine_torch_cores_and_load():
    header = results_header("bench.bench_zero")
    pattern = (r"## bench\.bench_zero — \d{4}-\d\d-\d\d \d\d:\d\d UTC, .+, torch " + re.escape(torch.__version__)
               + rf", {os.cpu_count()} cores, load \d+\.\d \d+\.\d \d+\.\d")
    assert re.fullmatch(pattern, header), header
