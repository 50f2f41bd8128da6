"""The launcher every peer-comparison bench shares (``run``, ``bench_zero``, ``bench_zero3``, ...).

An ``Entry`` is one row: a module run as ``nproc`` ranks of its own gloo world
(``python -m MODULE``, torchrun-style environment, one thread per rank) that
prints one ``BENCH_RESULT`` line (``common.report``). ``run_group`` runs rows
round-robin, repeat after repeat, so machine noise hits all of them alike, and
``summarize`` / ``pair_checks`` turn the runs into per-row medians and
megazero-against-peer ratios. Each bench's CLI and report live in its own module.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

from bench.common import RESULT_TAG
from megazero.parallel.state import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Entry:
    name: str
    module: str  # run as `python -m module` from the repository root
    args: list[str]
    nproc: int
    megazero: bool = False
    requires: str | None = None  # importable module the peer needs
    peer_of: list[str] = field(default_factory=list)  # for megazero rows: the peers it is compared with
    env: dict[str, str] = field(default_factory=dict)
    same_math: bool = True  # loss sequence must match the serial run
    cwd: str = ROOT  # the repository whose bench/ and megazero/ it runs (another copy: a before/after bench)


MZ = "bench.megazero_entry"
DP_PEERS = "bench.peers.data_parallel"
DS = {"DS_ACCELERATOR": "cpu"}


def launch(entry: Entry, extra: list[str], timeout: float = 600) -> dict:
    """Run ``entry`` as ``nproc`` ranks; rank 0's result record, or {"error": ...}."""
    port = str(free_port())
    procs = []
    for rank in range(entry.nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(entry.nproc),
               "LOCAL_WORLD_SIZE": str(entry.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **entry.env}
        procs.append(subprocess.Popen([sys.executable, "-m", entry.module, *entry.args, *extra], env=env,
                                      cwd=entry.cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for line in outs[0][0].splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = "\n".join(err for _, err in outs)[-2000:]
    return {"error": f"exit codes {[p.returncode for p in procs]}: {tail}"}


def installed(entry: Entry) -> bool:
    if entry.requires is None:
        return True
    try:
        return importlib.util.find_spec(entry.requires) is not None
    except ModuleNotFoundError:
        return False


def run_group(entries: list[Entry], repeats: int, extra: list[str], log) -> dict[str, dict]:
    """Round-robin the entries ``repeats`` times; per entry: the runs and their median tokens/s."""
    runs: dict[str, list[dict]] = {e.name: [] for e in entries}
    live = [e for e in entries if installed(e)]
    for r in range(repeats):
        for e in live:
            if runs[e.name] and "error" in runs[e.name][-1]:
                continue
            res = launch(e, extra)
            runs[e.name].append(res)
            log(f"  [{r + 1}/{repeats}] {e.name}: " + (f"{res['tokens_per_s']:.0f} tok/s" if "error" not in res
                                                     else "ERROR " + res["error"][-600:]))
    return {e.name: summarize(e, runs[e.name], installed(e)) for e in entries}


def summarize(entry: Entry, runs: list[dict], is_installed: bool) -> dict:
    if not is_installed:
        return {"status": f"not installed ({entry.requires})"}
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"status": "error", "error": runs[-1].get("error", "no run") if runs else "no run"}
    last = ok[-1]
    return {
        "status": "ok", "megazero": entry.megazero, "ranks": entry.nproc, "peer_of": entry.peer_of,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
        "tokens_per_s_runs": [r["tokens_per_s"] for r in ok],
        # tokens per CPU-second of the busiest rank: insensitive to other load on a shared machine
        "tokens_per_cpu_s": statistics.median(r["tokens_per_s"] * r["step_s"] / max(r["cpu_s_per_step"])
                                              for r in ok),
        "peak_rss_bytes": max(max(r["peak_rss_bytes"]) for r in ok),
        "model_state_bytes": max(last["model_state_bytes"]),
        "comm_bytes_per_step": max(last["comm_bytes_per_step"]),
        "comm_kinds_rank0": last["comm_kinds_rank0"], "losses": last["losses"],
        "command": f"-m {entry.module} {' '.join(entry.args)} (nproc={entry.nproc})",
    }


def loss_error(losses: list[float], reference: list[float]) -> float:
    n = min(len(losses), len(reference))
    if n == 0 or len(losses) != len(reference):
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(losses[:n], reference[:n]))


def pair_checks(results: dict[str, dict], reference: list[float],
                extra: Callable[[str, dict, str, dict], dict]) -> list[dict]:
    """Per (megazero row, peer): tokens/s ratios plus ``extra``'s checks; per row: loss agreement."""
    for r in results.values():
        if r.get("status") == "ok":
            r["loss_rel_err"] = loss_error(r["losses"], reference)
    checks = []
    for name, r in results.items():
        if r.get("status") != "ok" or not r["megazero"]:
            continue
        for peer in r["peer_of"]:
            p = results.get(peer, {})
            if p.get("status") != "ok":
                checks.append({"megazero": name, "peer": peer, "status": p.get("status", "missing")})
                continue
            checks.append({"megazero": name, "peer": peer, "ratio": r["tokens_per_s"] / p["tokens_per_s"],
                           "cpu_ratio": r["tokens_per_cpu_s"] / p["tokens_per_cpu_s"], **extra(name, r, peer, p)})
    return checks


def mib(x: float) -> str:
    return f"{x / 2 ** 20:.2f}"
