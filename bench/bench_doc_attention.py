"""Document-masked attention against full causal attention over the same packed sample, one process.

Issue 34 asks that, at 8K tokens with documents averaging ~512 tokens, the attention a
``--reset-attention-mask`` run computes (``cp_attention`` with the sample's bounds and no CP: one
causal SDPA per document, ``doc_blocks.document_attention``) be at least 4x faster than full causal
attention over the sample (what a run without the flag computes). Forward + backward, one thread,
the two rows alternating repetition by repetition so load on the machine falls on both alike;
medians after one untimed round. The documents are bench.bench_cp_peer's (seeded, 1 to 1023
tokens). The same comparison under the ring at cp 2 is bench.bench_cp_peer's p2p rows.

    .venv/bin/python -m bench.bench_doc_attention                    # S 8192, 4 heads of 64, 7 repeats
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.bench_cp_peer import document_bounds, document_lengths
from bench.results import add_out_flag, emit, results_header


def _seconds(f, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    f(q, k, v).backward(dout)
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per row, the seconds of each timed repetition."""
    from megazero.context_parallel import CPContext
    from megazero.context_parallel.attention import cp_attention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = [(1, args.heads, args.seq, args.head_dim)] * 4
    q, k, v, dout = (torch.randn(s, generator=g) for s in shapes)
    bounds = document_bounds(args.seq)
    rows = {"full causal": lambda q, k, v: cp_attention(q, k, v, CPContext()),
            "document mask": lambda q, k, v: cp_attention(q, k, v, CPContext(), bounds)}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for rep in range(args.repeats + 1):
        for name, f in rows.items():
            took = _seconds(f, q, k, v, dout)
            if rep:
                times[name].append(took)
    return times


def table(args: argparse.Namespace, times: dict[str, list[float]]) -> str:
    lengths = document_lengths(args.seq)
    full = statistics.median(times["full causal"])
    lines = [results_header("bench.bench_doc_attention"), "",
             f"S {args.seq}, heads {args.heads} of {args.head_dim}, batch 1, 1 thread; {len(lengths)} documents "
             f"(mean {statistics.mean(lengths):.0f} tokens); forward + backward, median of {args.repeats}", "",
             "| attention | ms (median) | ms (every run) | full causal / row |", "|---|---|---|---|"]
    for name, runs in times.items():
        med = statistics.median(runs)
        lines.append(f"| {name} | {med * 1e3:.0f} | {' '.join(f'{t * 1e3:.0f}' for t in runs)} | "
                     f"{full / med:.1f}x |")
    lines.append(f"\nload average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    add_out_flag(parser)
    args = parser.parse_args()
    emit(table(args, measure(args)), args.out)


if __name__ == "__main__":
    main()
