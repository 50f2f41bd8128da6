"""Slice arithmetic for resharding: which part of a full tensor a shard holds, and overlaps.

A region is a list of per-dim ``(start, stop)`` in full-tensor coordinates.
A TP shard of a tensor split along ``split_dim`` over ``tp`` ranks is the
rank's equal chunk of that dim; an expert shard is a run of experts along
dim 0 (by global expert id) and an etp chunk of ``split_dim``. Loading into
another layout intersects the region a rank needs with the regions the saved
files hold and copies only the overlaps, so no rank ever assembles the full
model.

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


def expert_region(full_shape: list[int] | tuple[int, ...], split_dim: int | None, first_expert: int,
                  local_experts: int, etp_rank: int, etp: int) -> Region:
    """The part of a full [E, ...] expert tensor one rank holds: experts [first, first + local) by global id,
    and its etp slice along ``split_dim``."""
    region = tp_region(full_shape, split_dim, etp_rank, etp)
    region[0] = (first_expert, first_expert + local_experts)
    return region


def intersect(a: Region, b: Region) -> Region | None:
    out = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b)]
    return out if all(lo < hi for lo, hi in out) else None


def relative(inner: Region, outer: Region) -> tuple[slice, ...]:
    """``inner`` (inside ``outer``) as slices into a tensor holding ``outer``."""
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(inner, outer))


def volume(region: Region) -> int:
    out = 1
    for lo, hi in region:
        out *= hi - lo
    return out


def cover_problem(pieces: list[Region], full: Region) -> str | None:
    """Why ``pieces`` do not cover ``full`` exactly once (None when they do).

    Identical pieces are copies of one piece (a tensor replicated over TP, the tied
    embedding on the first and last pipeline stage) and count once; distinct pieces must
    lie inside ``full``, must not overlap, and their volumes must add up to it (so no gap).
    """
    distinct = sorted({tuple(tuple(r) for r in p) for p in pieces})
    for p in distinct:
        if any(lo < f0 or hi > f1 for (lo, hi), (f0, f1) in zip(p, full)):
            return f"piece {[list(r) for r in p]} lies outside {[list(r) for r in full]}"
    if len(full) == 1:  # flat ranges: sorted, each must start where the previous one ended
        pairs = zip(distinct, distinct[1:])
    else:  # a handful of TP regions: compare every pair
        pairs = ((a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:])
    for a, b in pairs:
        if intersect(list(a), list(b)) is not None:
            return f"pieces {[list(r) for r in a]} and {[list(r) for r in b]} overlap"
    covered = sum(volume(list(p)) for p in distinct)
    if covered != volume(full):
        return f"pieces cover {covered} of its {volume(full)} elements (a gap)"
    return None
