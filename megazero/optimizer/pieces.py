"""Cutting a bucket's shard into pieces that fit the disk tier's host buffers, without changing a bit.

The disk store (``offload.py``) streams the optimizer state through a few host buffers of
``--offload-buffer-size`` shard elements each; a bucket whose shard is larger goes through in pieces.
AdamW is elementwise, but torch's fused CPU kernel is not bit-for-bit the same everywhere in a range:
it runs vectors over each range and a scalar loop (other rounding) over the range's last
``numel % vector width`` elements, and splits a range over threads only at multiples of 16 elements
from the range's start. So a cut is placed at a multiple of ``ALIGN`` elements past the start of the
weight-decay run (``adam.decay_runs``) it falls in: the elements before it stay in vector lanes and the
run's scalar tail stays where it was, and a chunked step is bitwise the whole-bucket one.
"""
from __future__ import annotations

from bisect import bisect_right

ALIGN = 64  # elements: a multiple of every fp32 vector width (4-16) and of the kernel's 16-element task unit
Runs = tuple[list[tuple[int, int]], list[tuple[int, int]]]  # (decayed, undecayed) ranges of a shard
Ranges = list[tuple[int, int]]  # sorted, disjoint [lo, hi) ranges of a shard


def piece_bounds(numel: int, runs: Runs | None, limit: int) -> list[tuple[int, int]]:
    """[lo, hi) pieces covering [0, numel), each at most ``limit`` elements (``limit`` >= ``ALIGN``),
    every cut a multiple of ``ALIGN`` past the start of the run it falls in (or of the shard)."""
    if limit < ALIGN:
        raise ValueError(f"--offload-buffer-size must be >= {ALIGN} elements, got {limit}.")
    starts = sorted({0, *(lo for ranges in (runs or ((), ())) for lo, _ in ranges)})
    step = limit - limit % ALIGN
    out, lo = [], 0
    while numel - lo > limit:
        cut = lo + step
        start = starts[bisect_right(starts, cut) - 1]
        cut = start + (cut - start) // ALIGN * ALIGN  # > lo: either start > lo or cut - start >= step
        out.append((lo, cut))
        lo = cut
    out.append((lo, numel))
    return out


def runs_in(runs: Runs, lo: int, hi: int) -> Runs:
    """``runs`` restricted to the piece [lo, hi), in the piece's coordinates."""
    return tuple([(max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges if a < hi and b > lo]
                 for ranges in runs)  # type: ignore[return-value]


def kept_in(kept: Ranges | None, lo: int, hi: int) -> int:
    """Elements of ``kept`` inside [lo, hi): the second-moment elements a (piece of a) shard stores. ``kept``: the
    shard's ranges that keep a second moment (Muon: its AdamW-trained segments), None: every element (AdamW)."""
    if kept is None:
        return hi - lo
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b in kept)


def compact_runs(runs: Runs, kept: Ranges, lo: int) -> Runs:
    """Where the piece at ``lo``'s ``runs`` (piece coordinates, each inside one range of ``kept``) sit in the piece's
    compact second moment: after the kept elements between the piece's start and the run's."""
    return tuple([(c, c + b - a) for a, b in ranges for c in [kept_in(kept, lo, lo + a)]]
                 for ranges in runs)  # type: ignore[return-value]
