"""megazero ZeRO 0/1/2 against torch DDP and DDP + ZeroRedundancyOptimizer (gloo, dp = 2; not run in CI).

    .venv/bin/python -m bench.bench_zero [--repeats 3] [--out bench/RESULTS_zero.md]

Uses the shared benchmark workload and launcher (``bench/common.py``,
``bench/run.py``): every entry trains the same seeded GPT-2 on the same
synthetic global batch with the same AdamW, each of 2 ranks on half of it,
entries round-robin so machine noise hits all alike, tokens/s the median.
Two extra megazero rows run 4 micro-batches per step, to show what ZeRO 2's
accumulation choice costs: the same bytes on the wire as ZeRO 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from bench import common
from bench.harness import MZ, ROOT, Entry, launch, mib, run_group
from bench.results import results_header
from bench.run import compare, groups

PEERS = ("torch DDP", "DDP + ZeroRedundancyOptimizer")
MEGAZERO = ("megazero zero 0", "megazero zero 1", "megazero zero 2")
PEER_OF = {"megazero zero 0": ["torch DDP"], "megazero zero 1": list(PEERS), "megazero zero 2": list(PEERS)}

ZERO2_NOTE = """\
**ZeRO 2 with several micro-batches.** Gradients of micro-batches 1..m-1 must be
kept somewhere until the last one has been added. Two choices: reduce-scatter every
bucket in every micro-batch's backward (m x the gradient traffic, but only the
buckets in flight are ever full-size), or accumulate into a transient full-size
bucket gradient and reduce-scatter once in the last micro-batch's backward (the
traffic of ZeRO 1, at the price of a full gradient buffer during accumulation).
megazero takes the second: the full-size bucket gradients are allocated on first
use in a step and each is freed as soon as its reduce-scatter into the persistent
1/dp shard completes (at most 2 reduce-scatters in flight), so with one micro-batch
no rank ever holds more than the buckets in flight plus the one filling, and with
m > 1 the step's gradient traffic stays 2(N-1)/N x the gradient bytes (rows with
4 micro-batches above: ZeRO 2 sends what ZeRO 1 sends). Between steps a rank holds
only its grad shard, which is what the start-up memory record measures.
"""


def entries() -> list[Entry]:
    dp = {e.name: e for e in groups()["dp"]}
    out = [dp[name] for name in (*MEGAZERO, *PEERS)]
    for e in out:
        if e.name in PEER_OF:
            e.peer_of = PEER_OF[e.name]
    for zero in (1, 2):
        out.append(Entry(f"megazero zero {zero}, 4 micro-batches", MZ,
                         ["--zero", str(zero), "--micro-batches", "4", "--bucket-size", "1000000"], 2, True,
                         peer_of=["torch DDP"]))
    return out


def _ratio(r: dict, peer: dict) -> str:
    return f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}" if peer.get("status") == "ok" else "-"


def write(path: str, results: dict[str, dict], checks: list[dict], repeats: int, seconds: float) -> str:
    ddp = results.get("torch DDP", {})
    lines = ["# ZeRO 0/1/2 against PyTorch's data-parallel peers (bench/bench_zero.py)", "",
             results_header("bench.bench_zero"), "",
             f"gloo on CPU, dp = 2, one thread per rank; model {common.MODEL}, global batch {common.GLOBAL_BATCH}, "
             f"{repeats} repeats round-robin (median tokens/s), {seconds:.0f} s in all, load taken at the end.", "",
             "| entry | tokens/s | / torch DDP | / DDP+ZeRO-Opt | model state/rank MiB | comm/step/rank MiB "
             "| grad+param bytes/step/rank MiB | loss rel err vs serial |", "|" + "---|" * 8]
    zro = results.get("DDP + ZeroRedundancyOptimizer", {})
    for name, r in results.items():
        if r.get("status") != "ok":
            lines.append(f"| {name} | {r.get('status')} | | | | | | |")
            continue
        kinds = r["comm_kinds_rank0"]
        sync = kinds["all_reduce"] if set(kinds) == {"all_reduce"} else \
            kinds.get("reduce_scatter", 0) + kinds.get("all_gather", 0)
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {_ratio(r, ddp)} | {_ratio(r, zro)} "
                     f"| {mib(r['model_state_bytes'])} | {mib(r['comm_bytes_per_step'])} | {mib(sync)} "
                     f"| {r.get('loss_rel_err', float('nan')):.1e} |")
    lines += ["", "Model state is measured from tensor storage (parameters, gradients, optimizer state) on the "
              "rank holding the most. ZeRO 1/2 rows send reduce-scatter + all-gather, DDP all-reduce; the "
              "comm column also counts the small all-reduces (loss, grad norm).", "", ZERO2_NOTE]
    text = "\n".join(lines)
    with open(path, "w") as fh:
        fh.write(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "RESULTS_zero.md"))
    args = parser.parse_args()
    extra = ["--steps", str(args.steps)] if args.steps else []
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    serial = launch(Entry("serial", MZ, [], 1), extra)
    if "error" in serial:
        raise SystemExit(f"the single-process reference failed: {serial['error']}")
    started = time.time()
    results = run_group(entries(), args.repeats, extra, log)
    checks = compare(results, serial["losses"])
    print(write(args.out, results, checks, args.repeats, time.time() - started))


if __name__ == "__main__":
    main()
