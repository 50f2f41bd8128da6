"""Context parallelism on this machine: a long sequence at cp 1 and cp 2 through pretrain_gpt.py.

    .venv/bin/python -m bench.bench_cp [--seq 8192] [--iters 6] [--out bench/RESULTS_cp.md]
    .venv/bin/python -m bench.bench_cp --memory [--seq 16384]     # peak RSS per rank: one rank against cp 4

One process per rank, one thread each (OMP_NUM_THREADS=1), the built-in corpus, a small gpt2
(2 layers, hidden 256, 4 heads of 64) at ``--seq`` tokens per sample, one sample per step, so
attention dominates the step. Rows: one rank; cp 2 with the ring (p2p); cp 2 with all-to-all
(a2a). Per row: the median step time over iterations 2.. (the first warms up), the speed-up
over one rank, and the time each rank spent blocked on the CP exchange (``--log-timers``: the
``cp`` axis of the comm-wait figures) as a share of the step. Per-rank balance of the attention
work and the contiguous-split baseline: ``bench/bench_cp_attention.py``.

``--memory``: two iterations at one rank and at cp 4 under ``/usr/bin/time``, whose maximum
resident set size is that of the largest process (the biggest rank): the memory a sequence
length needs on one rank against what each of 4 CP ranks needs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench.harness import ROOT
from bench.results import add_out_flag, emit, results_header

ROWS = (("1 rank", 1, []), ("cp 2, p2p ring", 2, ["--cp", "2"]),
        ("cp 2, a2a (Ulysses)", 2, ["--cp", "2", "--cp-comm-type", "a2a"]))


def model_flags(seq: int, iters: int) -> list[str]:
    return ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
            "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", str(iters), "--log-interval", "1", "--lr", "1e-4", "--log-timers"]


def run_row(nproc: int, flags: list[str], seq: int, iters: int) -> tuple[list[dict], int]:
    """The metrics records of one launch (comm waits are rank 0's) and the largest rank's peak RSS in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics, rss = os.path.join(tmp, "m.jsonl"), os.path.join(tmp, "rss")
        cmd = ["/usr/bin/time", "-f", "%M", "-o", rss, sys.executable, "-m", "torch.distributed.run",
               "--standalone", "--nproc_per_node", str(nproc), "pretrain_gpt.py", *model_flags(seq, iters), *flags,
               "--metrics-file", metrics]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        records = [r for r in map(json.loads, open(metrics).read().splitlines()) if "event" not in r]
        return records, int(open(rss).read().split()[-1]) * 1024


def summarise(records: list[dict]) -> dict:
    steps = records[1:]
    step = statistics.median(r["step_time_ms"] for r in steps)
    cp_wait = statistics.median(1000 * r.get("comm_wait_s", {}).get("cp", 0.0) for r in steps)
    return {"step_ms": step, "cp_wait_ms": cp_wait, "loss": records[-1]["loss"]}


def table(results: dict[str, dict], seq: int) -> str:
    base = results[ROWS[0][0]]["step_ms"]
    lines = [results_header("bench.bench_cp"), "",
             f"gpt2, 2 layers, hidden 256, 4 heads, seq {seq}, 1 sample per step, 1 thread per rank", "",
             "| layout | step ms (median) | speed-up vs 1 rank | blocked on CP exchange (rank 0) |",
             "|---|---|---|---|"]
    for name, r in results.items():
        share = f"{r['cp_wait_ms']:.0f} ms ({r['cp_wait_ms'] / r['step_ms']:.1%} of the step)" if "cp" in name else "-"
        lines.append(f"| {name} | {r['step_ms']:.0f} | {base / r['step_ms']:.2f}x | {share} |")
    return "\n".join(lines)


def memory_table(seq: int) -> str:
    lines = [results_header("bench.bench_cp --memory"), "",
             f"gpt2, 2 layers, hidden 256, 4 heads, seq {seq}, 1 sample per step, 2 iterations", "",
             "| layout | peak RSS of the largest rank |", "|---|---|"]
    for name, nproc, flags in (("1 rank", 1, []), ("cp 4, p2p ring", 4, ["--cp", "4"])):
        _, peak = run_row(nproc, flags, seq, 2)
        lines.append(f"| {name} | {peak / 2**30:.2f} GiB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--memory", action="store_true", help="peak RSS per rank, one rank against cp 4")
    add_out_flag(parser)
    args = parser.parse_args()
    if args.memory:
        text = memory_table(args.seq)
    else:
        results = {name: summarise(run_row(nproc, flags, args.seq, args.iters)[0]) for name, nproc, flags in ROWS}
        text = table(results, args.seq)
    emit(text, args.out)


if __name__ == "__main__":
    main()
