"""One MoE layer at ep 2 against megatron-core's and DeepSpeed's, side by side in one gloo world.

Issue 33 asks that megazero's MoE layer, forward + backward at ep 2, take at most 1.0x the time of
megatron-core 0.16.1's ``MoELayer`` (all-to-all dispatcher, dropless; ``bench/peers/megatron_moe.py``)
and at most 0.5x that of DeepSpeed 0.19.8's ``deepspeed.moe.layer.MoE`` (no token dropped:
``drop_tokens=False``; ``bench/peers/deepspeed_moe.py``). Workload: T = 1024 tokens per rank, H 256,
E 8 SwiGLU experts of width 512, top-2 (softmax over the two chosen logits, no balancing loss), fp32,
one thread per rank. The three layers hold the same weights and see the same tokens; their outputs and
input gradients are checked against each other before timing. Each repetition times every row once, in
turn (a barrier before each, the slowest rank's time counts; the order alternates), so load from other
work on the machine falls on all rows alike. Medians over ``--repeats`` after ``--warmup`` untimed rounds.
megazero's own blocked time in its all-to-alls (its ledger's ``ep`` axis, as ``--log-timers``) is
reported as a share of its layer time.

    .venv/bin/python -m bench.bench_moe                 # 9 repeats
    .venv/bin/python -m bench.bench_moe --repeats 15 --out bench/RESULTS_moe.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.results import add_out_flag, emit, results_header

ROWS = ("megazero", "megatron-core", "deepspeed")
BLOCKED = "megazero blocked in all-to-all"


def full_weights(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Seeded full [E, ...] tensors every implementation loads: router [E, H], gate/up [E, H, F], down [E, F, H]."""
    g = torch.Generator().manual_seed(0)
    e, h, f = args.experts, args.hidden, args.ffn

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    return {"router": normal(e, h, std=0.02), "gate": normal(e, h, f, std=h ** -0.5),
            "up": normal(e, h, f, std=h ** -0.5), "down": normal(e, f, h, std=f ** -0.5)}


def build_megazero(weights: dict[str, torch.Tensor], group, ep_rank: int, topk: int) -> tuple[Callable, object]:
    """megazero's MoELayer on ``group`` (its all-to-alls timed on a ledger's ``ep`` axis); f and the ledger."""
    from megazero.config import ModelConfig
    from megazero.moe.context import ExpertContext
    from megazero.moe.layer import MoELayer
    from megazero.parallel.collectives import CommLedger

    num_experts, hidden, ffn = weights["gate"].shape
    cfg = ModelConfig(arch="llama", num_layers=1, hidden_size=hidden, num_attention_heads=4, vocab_size=128,
                      num_experts=num_experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                      moe_router_load_balancing_type="none")
    ledger = CommLedger()
    ledger.name_group(group, "ep")
    ledger.timing = True
    layer = MoELayer(cfg, ExpertContext(ep_group=group), 0)
    mine = slice(ep_rank * layer.experts.num_local, (ep_rank + 1) * layer.experts.num_local)
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        layer.experts.fc1_weight.copy_(weights["up"][mine])
        layer.experts.gate_weight.copy_(weights["gate"][mine])
        layer.experts.fc2_weight.copy_(weights["down"][mine])

    def forward(x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    forward.parameters = layer.parameters  # type: ignore[attr-defined]
    return forward, ledger


def _time(f: Callable, x: torch.Tensor, dy: torch.Tensor, group) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """Forward + backward of one call; the slowest rank's [wall, CPU] seconds (CPU: the main thread's, which
    other load on the machine does not stretch), the output and the input gradient."""
    for p in f.parameters():  # type: ignore[attr-defined]
        p.grad = None
    x = x.detach().requires_grad_()
    dist.barrier(group=group)
    start, cpu_start = time.perf_counter(), time.thread_time()
    y = f(x)
    y.backward(dy)
    took = torch.tensor([time.perf_counter() - start, time.thread_time() - cpu_start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return took.tolist(), y.detach(), x.grad


def _check_agreement(outs: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int) -> dict[str, float]:
    """The same routing and experts: every peer's output and input gradient must match megazero's (fp32)."""
    errors = {}
    for name in ROWS[1:]:
        for what, mine, theirs in zip(("y", "dx"), outs[ROWS[0]], outs[name]):
            err = float((mine - theirs).abs().max() / mine.abs().max())
            errors[f"{name} {what}"] = err
            if err > 1e-4:
                raise AssertionError(f"rank {rank}: megazero and {name} differ in {what} by {err:.2e} (relative)")
    return errors


def _rank(rank: int, args: argparse.Namespace, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.ep)
    from bench.peers import deepspeed_moe, megatron_moe

    group = dist.new_group(list(range(args.ep)))
    weights = full_weights(args)
    mz, ledger = build_megazero(weights, group, rank, args.topk)
    rows = {ROWS[0]: mz, ROWS[1]: megatron_moe.build(weights, args.ep, rank, args.topk),
            ROWS[2]: deepspeed_moe.build(weights, args.ep, rank, args.topk)}
    g = torch.Generator().manual_seed(100 + rank)
    x, dy = torch.randn(args.tokens, 1, args.hidden, generator=g), torch.randn(args.tokens, 1, args.hidden, generator=g)
    outs = {name: _time(f, x, dy, group)[1:] for name, f in rows.items()}
    errors = _check_agreement(outs, rank)
    for _ in range(args.warmup - 1):
        for f in rows.values():
            _time(f, x, dy, group)
    times: dict[str, list[float]] = {name: [] for name in (*ROWS, BLOCKED)}
    for rep in range(args.repeats):
        for name in (ROWS if rep % 2 == 0 else reversed(ROWS)):  # alternate who goes first
            ledger.take_wait_seconds()
            times[name].append(_time(rows[name], x, dy, group)[0])
            if name == ROWS[0]:
                times[BLOCKED].append(ledger.take_wait_seconds().get("ep", 0.0))
    if rank == 0:
        with open(os.path.join(out_dir, "times.json"), "w") as f:
            json.dump({"times": times, "errors": errors}, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args, os.path.join(tmp, "init"), tmp), nprocs=args.ep, join=True)
        with open(os.path.join(tmp, "times.json")) as f:
            return json.load(f)


def table(args: argparse.Namespace, result: dict) -> str:
    times = result["times"]
    wall = {name: statistics.median(t[0] for t in times[name]) for name in ROWS}
    cpu = {name: statistics.median(t[1] for t in times[name]) for name in ROWS}
    blocked = statistics.median(times[BLOCKED])
    lines = [results_header("bench.bench_moe"), "",
             f"ep {args.ep}, T {args.tokens} tokens/rank, H {args.hidden}, E {args.experts} SwiGLU experts of "
             f"{args.ffn}, top-{args.topk}, fp32, 1 thread/rank; one MoE layer forward + backward, median of "
             f"{args.repeats} (slowest rank), order alternating; CPU: the rank's main thread", "",
             "| row | wall ms (median) | CPU ms (median) | wall ms (every run) | megazero / row: wall (CPU) |",
             "|---|---|---|---|---|"]
    for name in ROWS:
        runs = " ".join(f"{t[0] * 1e3:.0f}" for t in times[name])
        lines.append(f"| {name} | {wall[name] * 1e3:.1f} | {cpu[name] * 1e3:.1f} | {runs} | "
                     f"{wall[ROWS[0]] / wall[name]:.2f}x ({cpu[ROWS[0]] / cpu[name]:.2f}x) |")
    mz = wall[ROWS[0]]
    lines.append(f"\n{BLOCKED} (rank 0, median): {blocked * 1e3:.1f} ms = {blocked / mz:.1%} of its layer time")
    worst = max(result["errors"].values())
    lines.append(f"largest relative difference from megazero (outputs, input gradients): {worst:.1e}")
    lines.append(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    add_out_flag(parser)
    args = parser.parse_args()
    text = table(args, run(args))
    emit(text, args.out)


if __name__ == "__main__":
    main()
