"""Eager vs --compile (each transformer block compiled) through pretrain_gpt.py on this machine.

    .venv/bin/python -m bench.bench_compile [--seq 256] [--iters 6] [--out bench/RESULTS_speed.md]

Models: ``configs/gpt2-small.yaml`` (bf16, as the preset says) and a llama of the same shape
(``--arch llama --num-query-groups 4``: RoPE, RMSNorm, SwiGLU, GQA), on the built-in corpus,
``--seq`` tokens per sample and one 2-sample micro-batch per step, so a step fits a few seconds
on CPU. Layouts: one process and tp 2, one thread per rank (with two threads in one process,
OpenMP's barriers made eager steps ~7x slower while other jobs shared the 2 cores). Per row: tokens/s
as the median and the best over iterations 2.. (the first compiles; the best is the step least
disturbed by other jobs), and for --compile the compile time the
run reports ("megazero: --compile: compiled N block(s) in X s", forward and backward graphs,
inductor's on-disk cache as found: the first row on a fresh machine pays the C++ builds).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from bench.harness import ROOT
from bench.results import add_out_flag, emit, results_header
from megazero.parallel.state import free_port

MODELS = {"gpt2-small": ["--config", "configs/gpt2-small.yaml"],
          "llama (gpt2-small shape, GQA 4)": ["--config", "configs/gpt2-small.yaml", "--arch", "llama",
                                              "--num-query-groups", "4"]}
LAYOUTS = {"1 process": (1, []), "tp 2": (2, ["--tp", "2"])}
COMPILE_LINE = re.compile(r"--compile: compiled (\d+) block\(s\) in ([0-9.]+) s")


def run(model: list[str], nproc: int, layout: list[str], compiled: bool, seq: int, iters: int) -> dict:
    """One launch: median tokens/s over iterations 2.., the final loss, the reported compile seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        flags = [*model, *layout, "--seq-length", str(seq), "--micro-batch-size", "2", "--global-batch-size", "2",
                 "--train-iters", str(iters), "--log-interval", "1", "--lr-warmup-iters", "1",
                 "--metrics-file", metrics, *(["--compile"] if compiled else [])]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), "pretrain_gpt.py", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per rank: OpenMP barriers stall on a shared box
        out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
        records = [r for r in map(json.loads, open(metrics).read().splitlines()) if "event" not in r]
    found = COMPILE_LINE.search(out)
    speeds = [r["tokens_per_sec"] for r in records[1:]]
    return {"tokens_per_sec": statistics.median(speeds), "best": max(speeds),
            "loss": records[-1]["loss"], "compile_s": float(found.group(2)) if found else None}


def table(results: dict[tuple[str, str], dict[bool, dict]], seq: int) -> str:
    lines = [results_header("bench.bench_compile"), "",
             f"bf16, seq {seq}, 2 samples per step, 1 thread per rank; load taken at the end", "",
             "| model | layout | eager tokens/s median (best) | --compile tokens/s median (best) | speed-up "
             "median (best) | compile time | final loss eager / compiled |", "|---|---|---|---|---|---|---|"]
    for (model, layout), r in results.items():
        e, c = r[False], r[True]
        lines.append(f"| {model} | {layout} | {e['tokens_per_sec']:.0f} ({e['best']:.0f}) | "
                     f"{c['tokens_per_sec']:.0f} ({c['best']:.0f}) | {c['tokens_per_sec'] / e['tokens_per_sec']:.2f}x "
                     f"({c['best'] / e['best']:.2f}x) | {c['compile_s']:.0f} s | "
                     f"{e['loss']:.4f} / {c['loss']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=6)
    add_out_flag(parser)
    args = parser.parse_args()
    results = {}
    for model, model_flags in MODELS.items():
        for layout, (nproc, layout_flags) in LAYOUTS.items():
            results[model, layout] = {compiled: run(model_flags, nproc, layout_flags, compiled, args.seq, args.iters)
                                      for compiled in (False, True)}
            print(model, layout, results[model, layout], flush=True)
    text = table(results, args.seq)
    emit(text, args.out)


if __name__ == "__main__":
    main()
