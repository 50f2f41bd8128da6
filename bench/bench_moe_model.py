"""A 2-layer MoE GPT step at ep 2 against a dense GPT of equal active FLOPs, through pretrain_gpt.py.

Issue 33 asks that the MoE step take at most 1.3x the dense one, and that the time the MoE layers
spend blocked in their all-to-alls be at most 10% of their own time. Both models: llama, 2 layers,
hidden 256, 4 heads, seq 1024, one sample per rank (T = 1024 tokens per rank), 2 ranks, one thread
each, the built-in corpus. MoE: E 8 SwiGLU experts of width 512, top-2, ``--ep 2`` (the expert grid
folded over dp 2); dense: one SwiGLU MLP of width 1024 = k x 512, so both do the same FLOPs per token
but for the router's (H x E per token). Rows run in turn, launch after launch (order alternating),
so machine load falls on all alike; per launch the median step over iterations 2.. (the first warms
up), then the median over launches. MoE rows: with the force-balance router (every expert gets
exactly T k / E tokens: the benchmark setting the issue names) and with the learned router (at
initialisation its imbalance is large: the busiest ep rank sets the pace).

The MoE layers' own time comes from ``bench/moe_spans.py`` (each layer's forward call and backward
span, rank 0); the blocked time from ``--log-timers`` (the ledger's ``ep`` axis: seconds inside the
all-to-alls, rank 0).

    .venv/bin/python -m bench.bench_moe_model [--launches 3] [--iters 6] [--out bench/RESULTS_moe.md]
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

MODEL = ["--arch", "llama", "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "1024", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-4",
         "--log-interval", "1", "--log-timers"]
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--ep", "2"]
ROWS = {"dense, ffn 1024": ["--ffn-hidden-size", "1024"],
        "MoE ep 2, force-balance router": [*MOE, "--moe-router-force-balance"],
        "MoE ep 2, learned router": MOE}
DENSE = "dense, ffn 1024"


def launch(flags: list[str], iters: int) -> dict:
    """One 2-rank run: median step ms, and per step (rank 0) the MoE layers' ms and their blocked ep ms."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics, spans = os.path.join(tmp, "m.jsonl"), os.path.join(tmp, "spans")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "bench.moe_spans", spans, *MODEL, *flags, "--train-iters", str(iters), "--metrics-file", metrics]
        subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        steps = [r for r in map(json.loads, open(metrics).read().splitlines()) if "event" not in r][1:]
        calls = [json.loads(line) for line in open(spans + ".rank0").read().splitlines()]
    per_step = len(calls) // iters  # MoE layer calls per iteration (0 for the dense model)
    layer_s = [s["forward"] + s["backward"] for s in calls[per_step:]]  # without the first iteration
    return {"step_ms": statistics.median(r["step_time_ms"] for r in steps),
            "moe_ms": 1000 * sum(layer_s) / len(steps) if per_step else 0.0,
            "ep_wait_ms": 1000 * statistics.mean(r.get("comm_wait_s", {}).get("ep", 0.0) for r in steps),
            "imbalance": steps[-1].get("moe_imbalance")}


def run(launches: int, iters: int, log) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in ROWS}
    for i in range(launches):
        for name in (list(ROWS) if i % 2 == 0 else list(reversed(ROWS))):
            runs[name].append(launch(ROWS[name], iters))
            log(f"[{i + 1}/{launches}] {name}: {runs[name][-1]}")
    return runs


def table(runs: dict[str, list[dict]], launches: int, iters: int) -> str:
    step = {name: statistics.median(r["step_ms"] for r in rs) for name, rs in runs.items()}
    lines = [results_header("bench.bench_moe_model"), "",
             f"llama, 2 layers, hidden 256, 4 heads, seq 1024, 1 sample/rank, 2 ranks, 1 thread/rank; {launches} "
             f"launches per row in turn, {iters} iterations each (median step of iterations 2..{iters}, then the "
             "median over launches); MoE: E 8 x SwiGLU 512, top-2, --ep 2; dense: SwiGLU 1024", "",
             "| row | step ms (median) | steps (per launch) | step / dense | MoE layers ms/step (rank 0) | "
             "blocked in all-to-all ms/step | blocked / MoE layer time |", "|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        each = " ".join(f"{r['step_ms']:.0f}" for r in rs)
        if name == DENSE:
            lines.append(f"| {name} | {step[name]:.0f} | {each} | 1.00x | - | - | - |")
            continue
        moe = statistics.median(r["moe_ms"] for r in rs)
        wait = statistics.median(r["ep_wait_ms"] for r in rs)
        lines.append(f"| {name} | {step[name]:.0f} | {each} | {step[name] / step[DENSE]:.2f}x | {moe:.0f} | "
                     f"{wait:.1f} | {wait / moe:.1%} |")
    lines.append(f"\nload average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--iters", type=int, default=6)
    add_out_flag(parser)
    args = parser.parse_args()
    runs = run(args.launches, args.iters, lambda msg: print(msg, file=sys.stderr, flush=True))
    text = table(runs, args.launches, args.iters)
    emit(text, args.out)


if __name__ == "__main__":
    main()
