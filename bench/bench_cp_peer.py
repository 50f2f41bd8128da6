"""Context-parallel attention against DeepSpeed-Ulysses, side by side in one gloo world.

Issue 34 asks that megazero's cp 2 attention, with the ring (p2p) and with all-to-all (a2a), be at
least 1.1x as fast as DeepSpeed-Ulysses (``DistributedAttention`` around the same local attention,
``bench/peers/deepspeed_ulysses.py``) on a long sequence, with and without document masks. The
comparison is at the attention layer: this rank's q, k, v -> out, forward and backward, the rest of a
step being the same code for both. One world of ``--cp`` ranks, one thread each, holds every row; each
repetition times every row once, in turn (a barrier before each, the slowest rank's time counts), so
load from other work on the machine falls on all rows alike. Medians over ``--repeats`` after one
untimed round, of wall time and of CPU time (process time of the busiest rank, which other load does
not inflate, but which misses time spent waiting on the peer rank). The "no exchange" row is a floor:
the attention one Ulysses rank computes (n/cp heads of the whole sequence), with no exchange. The
"a2a, free exchange" row is megazero's all-to-all attention with every all-to-all replaced by a local
copy (wrong values, not checked): what the a2a row would take over a transport that costs nothing, an
upper bound on what any faster exchange could buy. Default
workload: the gpt2 of bench/bench_cp.py (4 heads of 64), 4096 tokens, documents of 1 to 1023 tokens
(mean ~512, seeded), batch 1.

    .venv/bin/python -m bench.bench_cp_peer                 # cp 2, S 4096, 7 repeats
    .venv/bin/python -m bench.bench_cp_peer --seq 8192 --repeats 5

Each rank gets the same seeded tensors: megazero's in its layout ([b, n, s, d], the load-balanced split
for p2p, the contiguous one for a2a), DeepSpeed's in its own ([b, s, n, d], contiguous split). Outputs
are checked against each other before timing (the same attention, so they must agree).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.results import add_out_flag, emit, results_header

ROWS = ("megazero p2p", "megazero a2a", "deepspeed-ulysses", "no exchange", "a2a, free exchange")


def document_lengths(seq: int, seed: int = 0, longest: int = 1023) -> list[int]:
    """Seeded document lengths, uniform in 1..``longest`` (mean ~512), the last cut to fill ``seq``."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(1, longest + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - seq
    return lengths


def document_bounds(seq: int, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """One sample's cu_seqlens (0, each later document's start, S) for ``document_lengths``."""
    cuts = [0]
    for n in document_lengths(seq, seed):
        cuts.append(cuts[-1] + n)
    return (tuple(cuts),)


class _Done:
    """The handle of an all-to-all that already happened."""

    def wait(self, *args) -> bool:
        return True


@contextlib.contextmanager
def _free_exchange():
    """megazero's all-to-alls become a local copy of as many elements as both buffers hold (the rest
    zeroed): the a2a row's compute and packing with an exchange that costs only a memcpy."""
    from megazero.parallel import collectives

    real = collectives.all_to_all_single

    def local(out, t, group, async_op=False, out_splits=None, in_splits=None):
        n = min(out.numel(), t.numel())
        out.view(-1)[:n].copy_(t.reshape(-1)[:n])
        out.view(-1)[n:].zero_()
        return _Done() if async_op else None

    collectives.all_to_all_single = local
    try:
        yield
    finally:
        collectives.all_to_all_single = real


def _attentions(rank: int, cp: int, bounds) -> dict:
    """Row name -> (f(q, k, v), CPSplit of its tokens, whether it takes [b, s, n, d], the context it
    runs in)."""
    from bench.peers.deepspeed_ulysses import ulysses_attention
    from megazero.context_parallel import CPContext, CPSplit
    from megazero.context_parallel.attention import cp_attention

    group = dist.new_group(list(range(cp)))
    p2p = CPContext(group=group, rank=rank, comm_type="p2p", split=CPSplit(cp, 1), ring_group=group)
    a2a = CPContext(group=group, rank=rank, comm_type="a2a", split=CPSplit(cp, cp), a2a_group=group)
    plain = contextlib.nullcontext
    return {ROWS[0]: (lambda q, k, v: cp_attention(q, k, v, p2p, bounds), p2p.split, False, plain),
            ROWS[1]: (lambda q, k, v: cp_attention(q, k, v, a2a, bounds), a2a.split, False, plain),
            ROWS[2]: (ulysses_attention(group, bounds), a2a.split, True, plain),
            ROWS[3]: (functools.partial(_local_only, cp=cp, bounds=bounds), a2a.split, False, plain),
            ROWS[4]: (lambda q, k, v: cp_attention(q, k, v, a2a, bounds), a2a.split, False, _free_exchange)}


def _local_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, bounds) -> torch.Tensor:
    """The floor: the attention one rank of Ulysses computes (n/cp heads, whole sequence), no exchange."""
    from megazero.context_parallel.doc_blocks import document_attention

    whole = [t[:, : t.shape[1] // cp].repeat(1, 1, cp, 1) for t in (q, k, v)]
    if bounds is None:
        out = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True)
    else:
        out = document_attention(*whole, bounds)
    return out.view(q.shape[0], q.shape[1] // cp, cp, q.shape[2], q.shape[3]).sum(2).repeat(1, cp, 1, 1)


def _inputs(args: argparse.Namespace, rank: int, split, bshd: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(1, args.heads, args.seq, args.head_dim)] + [(1, args.kv_heads, args.seq, args.head_dim)] * 2
    full = [torch.randn(s, generator=g) for s in shapes] + [torch.randn(shapes[0], generator=g)]
    local = [split.take(t, 2, rank) for t in full]
    return [t.transpose(1, 2).contiguous() if bshd else t for t in local]


def _time(row: tuple, inputs: list[torch.Tensor], group) -> tuple[list[float], torch.Tensor]:
    """Forward + backward of one call: [wall seconds, CPU seconds] of the slowest rank, and the output."""
    f, context = row[0], row[3]
    q, k, v = (t.detach().requires_grad_() for t in inputs[:3])
    dist.barrier(group=group)
    start, cpu = time.perf_counter(), time.process_time()
    with context():
        out = f(q, k, v)
        out.backward(inputs[3])
    took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return took.tolist(), out.detach()


def _rank(rank: int, args: argparse.Namespace, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.cp)
    group = dist.new_group(list(range(args.cp)))
    times: dict[str, list[list[float]]] = {}
    for masked in (False, True):
        bounds = document_bounds(args.seq) if masked else None
        rows = _attentions(rank, args.cp, bounds)
        inputs = {name: _inputs(args, rank, row[1], row[2]) for name, row in rows.items()}
        outs = {}
        for name, row in rows.items():  # the untimed round; its outputs are compared
            outs[name] = _time(row, inputs[name], group)[1]
        for rep in range(args.repeats):
            order = list(rows) if rep % 2 == 0 else list(reversed(rows))  # alternate who goes first
            for name in order:
                times.setdefault(f"{name}{' masked' if masked else ''}", []).append(
                    _time(rows[name], inputs[name], group)[0])
        _check_agreement(outs, rank)
    if rank == 0:
        with open(os.path.join(out_dir, "times.json"), "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _check_agreement(outs: dict, rank: int) -> None:
    """megazero a2a and DeepSpeed hold the same tokens: their outputs must agree (fp32 rounding)."""
    mz, ds = outs[ROWS[1]], outs[ROWS[2]].transpose(1, 2)
    err = (mz - ds).abs().max().item()
    if err > 1e-4:
        raise AssertionError(f"rank {rank}: megazero a2a and DeepSpeed-Ulysses differ by {err}")


def run(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args, os.path.join(tmp, "init"), tmp), nprocs=args.cp, join=True)
        with open(os.path.join(tmp, "times.json")) as f:
            return json.load(f)


def table(args: argparse.Namespace, times: dict[str, list[list[float]]]) -> str:
    """Medians of wall time and of CPU time (the busiest rank's: what other load on the machine does not
    inflate, but blind to time spent waiting), each with the peer's over the row's."""
    lines = [results_header("bench.bench_cp_peer"), "",
             f"cp {args.cp}, S {args.seq}, heads {args.heads}/{args.kv_heads} kv, d {args.head_dim}, batch 1, "
             f"1 thread/rank; attention forward + backward, median of {args.repeats} (slowest rank); "
             f"masked: {len(document_lengths(args.seq))} documents", "",
             "| row | wall ms (median) | wall ms (every run) | DeepSpeed-Ulysses / row (wall) | CPU ms (median) | "
             "DeepSpeed-Ulysses / row (CPU) |", "|---|---|---|---|---|---|"]
    for masked in ("", " masked"):
        peer = [statistics.median(run[i] for run in times[ROWS[2] + masked]) for i in (0, 1)]
        for name in ROWS:
            runs = times[name + masked]
            wall, cpu = (statistics.median(run[i] for run in runs) for i in (0, 1))
            lines.append(f"| {name}{masked} | {wall * 1e3:.0f} | {' '.join(f'{r[0] * 1e3:.0f}' for r in runs)} | "
                         f"{peer[0] / wall:.2f}x | {cpu * 1e3:.0f} | {peer[1] / cpu:.2f}x |")
    lines.append(f"\nload average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    add_out_flag(parser)
    args = parser.parse_args()
    emit(table(args, run(args)), args.out)


if __name__ == "__main__":
    main()
