"""Peak memory and time of the output head + loss, forward and backward: plain against chunked.

    .venv/bin/python -m bench.bench_fused_ce [--tokens 8192] [--vocab 32000] [--hidden 256] \\
        [--chunks 1024 4096] [--repeats 3]

Plain: ``column_parallel_linear`` then ``vocab_parallel_cross_entropy(...).mean()``, today's path,
which holds the fp32 logits [tokens, V] (as the softmax saved for backward). Chunked:
``fused_linear_cross_entropy`` (``--cross-entropy-chunk-size``), one chunk of logits at a time. One
process, tp 1, fp32, on the CPU. Peak: the most bytes the CPU allocator holds at once during one
forward + backward beyond what was live before (the profiler's raw allocation events; the head's
weight gradient exists already, as in training from the second step). Time: the median of
``--repeats`` forward + backward runs outside the profiler. Prints a markdown table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.results import results_header
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from megazero.tensor_parallel.layers import column_parallel_linear
from tests.helpers.peak_memory import peak_live_bytes

MB = 1e6


def head_and_loss(tokens: int, vocab: int, hidden: int, chunk: int):
    """A closure running one forward + backward of the head and loss (chunk 0: the plain path)."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(tokens, 1, hidden, generator=g)  # [s, b, h]
    weight = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * hidden ** -0.5)
    target = torch.randint(0, vocab, (tokens, 1), generator=g)

    def step() -> float:
        x = x0.clone().requires_grad_()
        if chunk:
            loss = fused_linear_cross_entropy(x, weight, target, None, vocab_size=vocab, chunk_size=chunk)
        else:
            loss = vocab_parallel_cross_entropy(column_parallel_linear(x, weight, None, None, False),
                                                target, None, vocab).mean()
        loss.backward()
        return float(loss.detach())

    step()  # weight.grad exists from here on: model state, not the head's activations
    return step


def measure(tokens: int, vocab: int, hidden: int, chunk: int, repeats: int) -> dict:
    step = head_and_loss(tokens, vocab, hidden, chunk)
    peak = peak_live_bytes(step)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    return {"chunk": chunk, "peak_bytes": peak, "seconds": statistics.median(times), "loss": loss}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    logits = a.tokens * a.vocab * 4
    rows = [measure(a.tokens, a.vocab, a.hidden, c, a.repeats) for c in [0, *a.chunks]]
    plain = rows[0]
    print(results_header("bench.bench_fused_ce") + "\n")
    print(f"{a.tokens} tokens x {a.vocab} vocab, hidden {a.hidden}, fp32, tp 1, {torch.get_num_threads()} "
          f"threads; fp32 logits {logits / MB:.0f} MB")
    print("| path | peak MB | saved vs plain MB | saved / fp32 logits | fwd+bwd s (median) | loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        saved = plain["peak_bytes"] - r["peak_bytes"]
        name = f"chunked, {r['chunk']} tokens" if r["chunk"] else "plain (head, then loss)"
        print(f"| {name} | {r['peak_bytes'] / MB:.0f} | {saved / MB:.0f} | {saved / logits:.2f} | "
              f"{r['seconds']:.2f} | {r['loss']:.6f} |")
    print(json.dumps({"tokens": a.tokens, "vocab": a.vocab, "hidden": a.hidden, "logits_fp32_bytes": logits,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
