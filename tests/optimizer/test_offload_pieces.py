"""The disk tier's host buffers follow --offload-buffer-size, not the bucket size (issue 22).

In one process, no world: a bucket shard larger than a buffer streams through in pieces; the pieces'
cuts keep torch's fused AdamW bitwise equal to the whole-shard update; the store's resident bytes are
K x 12 x the flag's elements; a sweep still reads the next piece ahead and writes the last behind; and
a whole-bucket sweep (what checkpoints read) sees what the piece sweeps wrote. The end-to-end bitwise
runs with buffers smaller than a bucket shard are in test_offload.py (``SMALL``).
"""
from __future__ import annotations

import random

import torch

from megazero.optimizer.adam import AdamHyper, adamw_shard_step
from megazero.optimizer.offload import KINDS, DiskStore
from megazero.optimizer.pieces import ALIGN, piece_bounds, runs_in

HYPER = AdamHyper(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)


def random_runs(rng: random.Random, n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Alternating decayed / undecayed segments at arbitrary (unaligned) offsets, as parameters lie in a bucket."""
    cuts = [0, *sorted(rng.sample(range(1, n), rng.randrange(1, 8))), n]
    segments = list(zip(cuts, cuts[1:]))
    return segments[0::2], segments[1::2]


def test_piece_cuts_keep_fused_adamw_bitwise():
    rng = random.Random(1)
    for trial in range(25):
        n = rng.randrange(3000, 40_000)
        runs, limit = random_runs(rng, n), rng.randrange(ALIGN, n)
        g = torch.Generator().manual_seed(trial)
        state = [torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1,
                 torch.rand(n, generator=g) * 0.01]  # master, grad, exp_avg, exp_avg_sq
        whole = [t.clone() for t in state]
        adamw_shard_step(*whole, runs, HYPER, 3)
        pieces = piece_bounds(n, runs, limit)
        assert pieces[0][0] == 0 and pieces[-1][1] == n and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(0 < hi - lo <= limit for lo, hi in pieces), (limit, pieces)
        for lo, hi in pieces:
            adamw_shard_step(*[t[lo:hi] for t in state], runs_in(runs, lo, hi), HYPER, 3)
        for name, a, b in zip(("master", "grad", "exp_avg", "exp_avg_sq"), whole, state):
            assert torch.equal(a, b), (trial, n, limit, name, int((a != b).sum()))


def test_disk_store_buffers_follow_the_flag_and_stream(tmp_path):
    shards = [[torch.randn(50_000), torch.randn(3_000)], [torch.randn(70)]]
    store = DiskStore(shards, str(tmp_path), rank=0, buffers=2, buffer_size=1000)
    try:
        assert store.host_bytes() == 2 * KINDS * 1000 * 4 < KINDS * 50_000 * 4  # the flag's size, not the bucket's
        assert len(store.pieces) >= 50 + 3 + 1
        submitted: list[tuple[str, int]] = []
        submit = store.io.submit
        store.io.submit = lambda fn, p, *a: (submitted.append((fn.__name__, p)), submit(fn, p, *a))[1]
        seen = []
        for i, lo, views in store.sweep():
            p = len(seen)
            # read-ahead: the next piece's read went out before this one was handed over; write-behind:
            # the previous piece's write went out, and nothing waits for this one's yet
            assert ("_pread", p + 1) in submitted or p + 1 == len(store.pieces), (p, submitted[-3:])
            assert p == 0 or ("_pwrite", p - 1) in submitted
            assert ("_pwrite", p) not in submitted
            assert len(views[0]) <= 1000
            views[1].copy_(torch.arange(lo, lo + len(views[1]), dtype=torch.float32) + 1e6 * i)
            seen.append((i, lo, len(views[0])))
        store.io.submit = submit
        for i, lo, (master, exp_avg, exp_avg_sq) in store.sweep(whole=True):  # what a checkpoint reads
            flat = shards[0] + shards[1]
            assert lo == 0 and torch.equal(master, flat[i]) and not exp_avg_sq.any()
            assert torch.equal(exp_avg, torch.arange(flat[i].numel(), dtype=torch.float32) + 1e6 * i), i
        assert [sum(n for j, _, n in seen if j == i) for i in range(3)] == [50_000, 3_000, 70]
    finally:
        store.close()
