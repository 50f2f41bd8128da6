"""Slice arithmetic for resharding: which part of a full tensor a shard holds, and overlaps.

A region is a list of per-dim ``(start, stop)`` in full-tensor coordinates.
A TP shard of a tensor split along ``split_dim`` over ``tp`` ranks is the
rank's equal chunk of that dim. Loading into another layout intersects the
region a rank needs with the regions the saved files hold and copies only
the overlaps, so no rank ever assembles the full model.

Vocabulary padding makes the *full* shape of embedding-like tensors depend
on the TP size; rows past the real vocabulary are zero, so overlaps are
clipped to the saved extent and the remaining rows stay zero.
"""
from __future__ import annotations

Region = list[tuple[int, int]]


def tp_region(full_shape: list[int] | tuple[int, ...], split_dim: int | None, tp_rank: int, tp: int) -> Region:
    region = [(0, n) for n in full_shape]
    if split_dim is not None and tp > 1:
        size = full_shape[split_dim] // tp
        region[split_dim] = (tp_rank * size, (tp_rank + 1) * size)
    return region


def intersect(a: Region, b: Region) -> Region | None:
    out = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b)]
    return out if all(lo < hi for lo, hi in out) else None


def relative(inner: Region, outer: Region) -> tuple[slice, ...]:
    """``inner`` (inside ``outer``) as slices into a tensor holding ``outer``."""
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(inner, outer))

