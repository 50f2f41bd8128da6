"""Elements per second of one AdamW step on the host: the kernel ZeRO-Offload's step runs.

Issue 16 asks for a fast multi-threaded CPU AdamW ("torch's fused/foreach CPU AdamW or better:
measure"), with the anchor "DeepSpeed's CPU Adam is 5-7x faster than torch's CPU Adam". Every
row updates one 64M-element fp32 shard (parameter, gradient and both moments: 1 GiB of state
moved per step) with the same hyper-parameters, in a fresh process per (row, threads) so no
row inherits another's allocator or thread pool:

    megazero          ``adamw_shard_step`` (torch's fused CPU kernel over decay runs)
    torch-fused       ``torch.optim.AdamW(fused=True)``
    torch-foreach     ``torch.optim.AdamW(foreach=True)`` (multi-tensor ops, one pass per op)
    torch-for-loop    ``torch.optim.AdamW(foreach=False)`` (single-tensor ops)
    deepspeed         ``DeepSpeedCPUAdam(adamw_mode=True)`` (its JIT-built AVX C++ kernel)

``WARMUP`` untimed steps, then the median of ``REPEATS`` timed ones; the load average is
recorded around each row, since other jobs on a shared machine slow every row. Nothing here is
asserted by the test suite; results: bench/RESULTS_cpu_adam.md.

    .venv/bin/python -m bench.bench_cpu_adam                  # every row at 1 and 2 threads
    .venv/bin/python -m bench.bench_cpu_adam --rows megazero --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.harness import ROOT
from bench.results import results_header

NUMEL = 64 * 2 ** 20
WARMUP, REPEATS = 2, 7
LR, BETAS, EPS, DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.1
ROWS = ("megazero", "torch-fused", "torch-foreach", "torch-for-loop", "deepspeed")
TAG = "CPU_ADAM_RESULT "


def state():
    """(param, grad) of NUMEL fp32 elements, seeded, first touched here (not in the timed steps)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g) * 1e-3


def megazero_step():
    import torch

    from megazero.optimizer.adam import AdamHyper, adamw_shard_step

    param, grad = state()
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    hyper = AdamHyper(lr=LR, weight_decay=DECAY, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    runs = ([(0, NUMEL)], [])  # the whole shard decayed
    count = [0]

    def step() -> None:
        count[0] += 1
        adamw_shard_step(param, grad, exp_avg, exp_avg_sq, runs, hyper, count[0])

    return step


def torch_step(kind: str):
    import torch

    param, grad = state()
    p = torch.nn.Parameter(param)
    p.grad = grad
    options = {"torch-fused": dict(fused=True), "torch-foreach": dict(foreach=True, fused=False),
               "torch-for-loop": dict(foreach=False, fused=False)}[kind]
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, **options)
    return opt.step


def deepspeed_step():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param, grad = state()
    p = torch.nn.Parameter(param)
    p.grad = grad
    opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, adamw_mode=True)
    return opt.step


def measure(row: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    step = megazero_step() if row == "megazero" else deepspeed_step() if row == "deepspeed" else torch_step(row)
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"row": row, "threads": threads, "median_s": median, "min_s": min(times),
            "g_elements_per_s": NUMEL / median / 1e9, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def run_row(row: str, threads: int) -> dict:
    """One (row, threads) in a fresh process; a failed row returns its error (the last lines of stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu"}
    load_before = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-m", "bench.bench_cpu_adam", "--worker", row, "--threads", str(threads)],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    load = {"load_before": load_before, "load_after": os.getloadavg()[0]}
    for line in out.stdout.splitlines():
        if line.startswith(TAG):
            return {**json.loads(line[len(TAG):]), **load}
    tail = (out.stderr or out.stdout).strip().splitlines()[-6:]
    return {"row": row, "threads": threads, "error": " | ".join(tail), **load}


def table(results: list[dict]) -> str:
    """Markdown rows; the speed-up is against torch's single-tensor loop at the same thread count."""
    loop = {r["threads"]: r for r in results if r["row"] == "torch-for-loop" and "error" not in r}
    lines = ["| row | threads | median ms | G elements/s | vs for-loop | load avg before/after |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['threads']} | failed: {r['error'][:300]} ||||")
            continue
        base = loop.get(r["threads"])
        ratio = f"{base['median_s'] / r['median_s']:.2f}x" if base else ""
        lines.append(f"| {r['row']} | {r['threads']} | {1000 * r['median_s']:.0f} | {r['g_elements_per_s']:.3f} "
                     f"| {ratio} | {r['load_before']:.2f} / {r['load_after']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(TAG + json.dumps(measure(args.worker, args.threads[0])), flush=True)
        return
    results = []
    for threads in args.threads:
        for row in args.rows:
            results.append(run_row(row, threads))
            print(json.dumps(results[-1]), flush=True)
    print(results_header("bench.bench_cpu_adam") + "\n\n" + table(results))


if __name__ == "__main__":
    main()
