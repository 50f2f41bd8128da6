"""megazero against its peers on one fixed workload: one table, plus JSON (the CLI; ``harness.py`` launches).

    .venv/bin/python -m bench.run [--repeats 5] [--groups dp,tp,pp2,pp4] [--json bench/results.json]
    .venv/bin/python -m bench.run --groups tp --shape llama-gqa     # the TP rows on another workload

Each entry is its own world of ranks (OMP_NUM_THREADS=1, gloo). Within a row
group the entries run round-robin, repeat after repeat (A B C A B C ...), so
machine noise hits all of them alike; tokens/s is the median over repeats.
A peer whose package is missing is reported as "not installed".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.harness import DP_PEERS, DS, MZ, ROOT, Entry, launch, mib, pair_checks, run_group
from bench.results import results_header


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
        Entry("DeepSpeed ZeRO-1", "bench.peers.deepspeed_zero", ["--stage", "1"], 2, requires="deepspeed", env=DS),
        Entry("DeepSpeed ZeRO-2", "bench.peers.deepspeed_zero", ["--stage", "2"], 2, requires="deepspeed", env=DS),
    ]
    tp = [
        Entry("megazero TP=2", MZ, ["--tp", "2"], 2, True, peer_of=["torch DTensor TP", "megatron-core TP"]),
        Entry("torch DTensor TP", "bench.peers.tensor_parallel", ["--impl", "dtensor"], 2),
        Entry("megatron-core TP", "bench.peers.tensor_parallel", ["--impl", "megatron"], 2,
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
            rows.append(Entry(peer, "bench.peers.pipeline", ["--schedule", sched, "--pp", str(pp)], pp))
        out[f"pp{pp}"] = rows
    return out


ZERO_STAGE = {"megazero zero 0": 0, "megazero zero 1": 1, "megazero zero 2": 2, "torch DDP": 0,
              "DDP + ZeroRedundancyOptimizer": 1, "DeepSpeed ZeRO-1": 1, "DeepSpeed ZeRO-2": 2,
              "FSDP2 reshard=False": 3, "FSDP2 reshard=True": 3}


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
    header = results_header("bench.run")
    out = {"command": "python -m bench.run " + " ".join(sys.argv[1:]), "header": header,
           "load_avg": os.getloadavg(), "seconds": time.time() - started, "repeats": args.repeats,
           "serial_losses": serial["losses"], "results": results, "checks": checks}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(header + "\n\n" + table(results, checks))
    print("\n" + verdict(checks))


def verdict(checks: list[dict]) -> str:
    """One line per failed property of a (megazero row, peer) pair."""
    bad = []
    for c in checks:
        why = [w for w, failed in (("slower", c.get("ratio", 1.0) < 1.0),
                                   ("more model state", c.get("state_ok") is False),
                                   ("more bytes (total)", c.get("bytes_ok") is False),
                                   ("more grad+param bytes", c.get("grad_param_bytes_ok") is False)) if failed]
        if why:
            bad.append(f"- {c['megazero']} vs {c['peer']}: {', '.join(why)}")
    return f"{len(checks)} comparisons, {len(bad)} with a failed property" + "".join("\n" + b for b in bad)


if __name__ == "__main__":
    main()
