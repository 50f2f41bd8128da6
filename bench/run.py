"""megazero against its peers on one fixed workload: one table, plus JSON.

    python bench/run.py [--repeats 5] [--groups dp,tp,pp2,pp4] [--json bench/results.json]
    python bench/run.py --groups tp --shape llama-gqa     # the TP rows on another workload

Each entry is its own world of ranks (OMP_NUM_THREADS=1, gloo). Within a row
group the entries run round-robin, repeat after repeat (A B C A B C ...), so
machine noise hits all of them alike; tokens/s is the median over repeats.
A peer whose package is missing is reported as "not installed".
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import RESULT_TAG  # noqa: E402


@dataclass
class Entry:
    name: str
    script: str
    args: list[str]
    nproc: int
    megazero: bool = False
    requires: str | None = None  # importable module the peer needs
    peer_of: list[str] = field(default_factory=list)  # for megazero rows: the peers it is compared with
    env: dict[str, str] = field(default_factory=dict)
    same_math: bool = True  # loss sequence must match the serial run


MZ = "bench/megazero_entry.py"
DP_PEERS = "bench/peers/data_parallel.py"
DS = {"DS_ACCELERATOR": "cpu"}


def groups() -> dict[str, list[Entry]]:
    dp_peers = ["torch DDP", "DDP + ZeroRedundancyOptimizer", "FSDP2 reshard=False", "FSDP2 reshard=True",
                "DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2"]
    dp = [
        Entry("megazero zero 0", MZ, ["--zero", "0"], 2, True, peer_of=["torch DDP"]),
        Entry("megazero zero 1", MZ, ["--zero", "1"], 2, True,
              peer_of=["torch DDP", "DDP + ZeroRedundancyOptimizer", "DeepSpeed ZeRO-1"]),
        Entry("megazero zero 2", MZ, ["--zero", "2", "--bucket-size", "1000000"], 2, True, peer_of=dp_peers),
        Entry("torch DDP", DP_PEERS, ["--mode", "ddp"], 2),
        Entry("DDP + ZeroRedundancyOptimizer", DP_PEERS, ["--mode", "zero1"], 2),
        Entry("FSDP2 reshard=False", DP_PEERS, ["--mode", "fsdp2"], 2),
        Entry("FSDP2 reshard=True", DP_PEERS, ["--mode", "fsdp2-reshard"], 2),
        Entry("DeepSpeed ZeRO-1", "bench/peers/deepspeed_zero.py", ["--stage", "1"], 2, requires="deepspeed", env=DS),
        Entry("DeepSpeed ZeRO-2", "bench/peers/deepspeed_zero.py", ["--stage", "2"], 2, requires="deepspeed", env=DS),
    ]
    tp = [
        Entry("megazero TP=2", MZ, ["--tp", "2"], 2, True, peer_of=["torch DTensor TP", "megatron-core TP"]),
        Entry("torch DTensor TP", "bench/peers/tensor_parallel.py", ["--impl", "dtensor"], 2),
        Entry("megatron-core TP", "bench/peers/tensor_parallel.py", ["--impl", "megatron"], 2,
              requires="megatron.core"),
    ]
    out = {"dp": dp, "tp": tp}
    for pp in (2, 4):
        rows = []
        for sched, torch_name in (("gpipe", "GPipe"), ("1f1b", "1F1B"), ("interleaved", "Interleaved1F1B")):
            if sched == "interleaved" and pp * 2 > 4:
                continue  # 4 layers cannot make 2 chunks per rank on 4 stages
            extra = ["--vp", "2"] if sched == "interleaved" else []
            peer = f"torch Schedule{torch_name} pp={pp}"
            rows.append(Entry(f"megazero {sched} pp={pp}", MZ, ["--pp", str(pp), "--schedule", sched,
                                                               "--micro-batches", "8", *extra], pp, True,
                              peer_of=[peer]))
            rows.append(Entry(peer, "bench/peers/pipeline.py", ["--schedule", sched, "--pp", str(pp)], pp))
        out[f"pp{pp}"] = rows
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(entry: Entry, extra: list[str], timeout: float = 600) -> dict:
    """Run ``entry`` as ``nproc`` ranks; rank 0's result record, or {"error": ...}."""
    port = str(_free_port())
    procs = []
    for rank in range(entry.nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(entry.nproc),
               "LOCAL_WORLD_SIZE": str(entry.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": ROOT, **entry.env}
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, entry.script), *entry.args, *extra],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
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
        "command": f"{entry.script} {' '.join(entry.args)} (nproc={entry.nproc})",
    }


ZERO_STAGE = {"megazero zero 0": 0, "megazero zero 1": 1, "megazero zero 2": 2, "torch DDP": 0,
              "DDP + ZeroRedundancyOptimizer": 1, "DeepSpeed ZeRO-1": 1, "DeepSpeed ZeRO-2": 2,
              "FSDP2 reshard=False": 3, "FSDP2 reshard=True": 3}


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


def compare(results: dict[str, dict], reference: list[float]) -> list[dict]:
    """Per (megazero row, peer): speed ratio, state and bytes checks; per row: loss agreement."""

    def extra(name: str, r: dict, peer: str, p: dict) -> dict:
        check = {}
        if ZERO_STAGE.get(peer) == ZERO_STAGE.get(name):
            check["state_ok"] = r["model_state_bytes"] <= p["model_state_bytes"]
        if peer == "torch DDP":
            check["bytes_ok"] = r["comm_bytes_per_step"] <= p["comm_bytes_per_step"]
            check["grad_param_bytes_ok"] = grad_param_bytes(r) <= p["comm_bytes_per_step"]
        return check

    return pair_checks(results, reference, extra)


def grad_param_bytes(r: dict) -> float:
    """Gradient reduction + parameter gathering bytes (without the grad-norm scalar's all-reduce)."""
    kinds = r["comm_kinds_rank0"]
    if "all_reduce" in kinds and len(kinds) == 1:
        return kinds["all_reduce"]
    return kinds.get("reduce_scatter", 0) + kinds.get("all_gather", 0) + kinds.get("reduce", 0)


def mib(x: float) -> str:
    return f"{x / 2 ** 20:.2f}"


def table(results: dict[str, dict], checks: list[dict]) -> str:
    """The markdown table: one row per entry; megazero rows carry their ratios to each peer."""
    ratios: dict[str, list[str]] = {}
    for c in checks:
        if "ratio" in c:
            ratios.setdefault(c["megazero"], []).append(f"{c['ratio']:.2f} ({c['cpu_ratio']:.2f}) vs {c['peer']}")
    lines = ["| entry | ranks | tokens/s (median) | tokens/CPU-s | megazero/peer: tokens/s (tokens/CPU-s) "
             "| peak RSS/rank MiB | model state/rank MiB | comm/step/rank MiB | loss rel err vs serial |",
             "|" + "---|" * 9]
    for name, r in results.items():
        if r.get("status") != "ok":
            lines.append(f"| {name} | | {r.get('status')} | | | | | | |")
            continue
        lines.append(f"| {name} | {r['ranks']} | {r['tokens_per_s']:.0f} | {r['tokens_per_cpu_s']:.0f} "
                     f"| {'; '.join(ratios.get(name, []))} "
                     f"| {mib(r['peak_rss_bytes'])} | {mib(r['model_state_bytes'])} "
                     f"| {mib(r['comm_bytes_per_step'])} | {r['loss_rel_err']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", default="dp,tp,pp2,pp4")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "results.json"))
    parser.add_argument("--only", default="", help="comma-separated entry names to run (default: every entry)")
    parser.add_argument("--shape", default="default",
                        help="workload of bench/common.py SHAPES; other than default only for --groups tp")
    args = parser.parse_args()
    if args.shape != "default" and args.groups != "tp":
        parser.error(f"--shape {args.shape} applies to --groups tp only (the other peers run the default shape)")
    extra = [*(["--steps", str(args.steps)] if args.steps else []),
             *(["--warmup", str(args.warmup)] if args.warmup else []),
             *(["--shape", args.shape] if args.shape != "default" else [])]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    serial = launch(Entry("serial", MZ, [], 1), extra)
    if "error" in serial:
        raise SystemExit(f"the single-process reference failed: {serial['error']}")
    results: dict[str, dict] = {}
    started = time.time()
    all_groups = groups()
    for g in args.groups.split(","):
        log(f"group {g}:")
        keep = [e for e in all_groups[g] if not args.only or e.name in args.only.split(",")]
        results.update(run_group(keep, args.repeats, extra, log))
    checks = compare(results, serial["losses"])
    out = {"command": "python bench/run.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
           "load_avg": os.getloadavg(), "seconds": time.time() - started, "repeats": args.repeats,
           "serial_losses": serial["losses"], "results": results, "checks": checks}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(table(results, checks))
    print("\n" + verdict(checks))


def verdict(checks: list[dict]) -> str:
    """One line per failed property of a (megazero row, peer) pair."""
    bad = []
    for c in checks:
        why = [w for w, failed in (("slower", c.get("ratio", 1.0) < 1.0), ("more model state", c.get("state_ok") is False),
                                   ("more bytes (total)", c.get("bytes_ok") is False),
                                   ("more grad+param bytes", c.get("grad_param_bytes_ok") is False)) if failed]
        if why:
            bad.append(f"- {c['megazero']} vs {c['peer']}: {', '.join(why)}")
    return f"{len(checks)} comparisons, {len(bad)} with a failed property" + "".join("\n" + b for b in bad)


if __name__ == "__main__":
    main()
