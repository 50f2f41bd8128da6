"""Where Muon's elements travel each step, from shapes alone: each matrix's direction from the ranks that hold
its pieces to its owner (``gather_routes``), and the owner's NS output back to every rank holding an element of
it (``scatter_routes``). ``optimizer/muon_shards.py`` sends along these routes and ``memory/muon_traffic.py``
counts them before any process starts, so the two agree on every byte.

A holder set (``Holders``) is a grid of R reduction ranks x tp (E)TP ranks, set rank ``s * tp + t``. A bucket of
n padded TP-local elements is cut into S = R shards (ZeRO >= 1) or held whole by every reduction rank (S = 1,
ZeRO 0). A weight's TP piece t is its full (TP-joined) tensor narrowed along its split dim; an unsplit weight is
whole on every TP rank. An element's source for owner o = (s_o, t_o) is the rank that holds it nearest o: its
shard's rank (S = R) or o's own reduction rank (S = 1); its TP piece's rank (split) or o's own (unsplit, as the
all-gather scheme used o's copy). Its destinations are all of its holders. Pieces are listed in one order
(weight, matrix, TP piece, row range, shard), which both ends of a route compute alike.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from math import prod
from typing import Iterator

from .muon import Matrix

Piece = tuple[int, int, int, int, int]  # (weight index in the bucket, matrix number in the set, TP piece, lo, hi)
Routes = dict[tuple[int, int], list[Piece]]  # (sending set rank, receiving set rank) -> pieces, in order


@dataclass(frozen=True)
class WeightGeometry:
    """One Muon weight of a bucket: its first element (bucket coordinates, TP-local), full shape, split dim
    (None: whole on every TP rank), matrices and the set number of its first matrix."""

    offset: int
    full_shape: tuple[int, ...]
    split_dim: int | None
    matrices: tuple[Matrix, ...]
    first: int


def local_runs(full_shape: tuple[int, ...], split_dim: int | None, tp: int, m: Matrix,
               t: int) -> list[tuple[int, int]]:
    """Matrix ``m``'s elements in TP piece ``t`` of its weight, as flat runs of the piece: its rows (dim 0 of a
    2-D weight, dim 1 of a 3-D expert weight) take every element of the trailing dims, so each row range is one."""
    rdim = 0 if m.expert is None else 1
    local = list(full_shape)
    if split_dim is not None:
        assert split_dim >= rdim, f"a split along dim {split_dim} crosses Muon's matrices"
        local[split_dim] //= tp
    stride = prod(local[rdim + 1:])
    base = 0 if m.expert is None else m.expert * prod(local[1:])
    out = []
    for lo, hi in m.rows:
        if split_dim == rdim:
            width = local[rdim]
            lo, hi = max(lo, t * width) - t * width, min(hi, (t + 1) * width) - t * width
            if lo >= hi:
                continue
        out.append((base + lo * stride, base + hi * stride))
    return out


def _cuts(lo: int, hi: int, shard: int, shards: int, reduction: int,
          near: int | None) -> Iterator[tuple[int, int, int]]:
    """(reduction rank, lo, hi) of bucket range [lo, hi): its shards' ranks (``shards`` > 1), or ``near`` (a
    source at ZeRO 0, where every reduction rank holds it) / every reduction rank (``near`` None: destinations)."""
    if shards == 1:
        for s in range(reduction) if near is None else (near,):
            yield s, lo, hi
        return
    for s in range(lo // shard, (hi - 1) // shard + 1):
        yield s, max(lo, s * shard), min(hi, (s + 1) * shard)


def _routes(weights: list[WeightGeometry], numel: int, owners: list[int], reduction: int, tp: int,
            shards: int, to_owner: bool) -> Routes:
    shard = numel // shards
    routes: Routes = defaultdict(list)
    for wi, w in enumerate(weights):
        split = w.split_dim is not None
        for j, m in enumerate(w.matrices):
            k = w.first + j
            s_o, t_o = divmod(owners[k], tp)
            pieces = range(tp) if split or not to_owner else (t_o,)
            for t in pieces:
                for lo, hi in local_runs(w.full_shape, w.split_dim, tp, m, t if split else 0):
                    for s, a, b in _cuts(w.offset + lo, w.offset + hi, shard, shards, reduction,
                                         s_o if to_owner else None):
                        pair = (s * tp + t, owners[k]) if to_owner else (owners[k], s * tp + t)
                        routes[pair].append((wi, k, t, a - w.offset, b - w.offset))
    return dict(routes)


def gather_routes(weights: list[WeightGeometry], numel: int, owners: list[int], reduction: int, tp: int,
                  shards: int) -> Routes:
    """Each matrix's direction pieces of one bucket (``numel`` padded elements), source -> owner."""
    return _routes(weights, numel, owners, reduction, tp, shards, True)


def scatter_routes(weights: list[WeightGeometry], numel: int, owners: list[int], reduction: int, tp: int,
                   shards: int) -> Routes:
    """Each matrix's NS output pieces of one bucket, owner -> every rank holding them."""
    return _routes(weights, numel, owners, reduction, tp, shards, False)


def sent(routes: Routes, rank: int) -> int:
    """Elements set rank ``rank`` sends along ``routes`` (what it keeps for itself is not sent)."""
    return sum(hi - lo for (src, dst), pieces in routes.items() if src == rank != dst for _, _, _, lo, hi in pieces)
