"""Megatron-core's rank-group rules, written out independently, as the reference the expert grid is tested against.

Megatron (``megatron/core/parallel_state.py``, ``RankGenerator`` and ``initialize_model_parallel``) orders the
axes tp-cp-ep-dp-pp, fastest first. A rank is the mixed-radix number of its coordinates in that order. The
groups of a set of axes ("tp-ep") hold the ranks that differ only along those axes, each group listed by its
coordinates along them (first axis fastest), the groups listed by the other coordinates (first axis fastest).
The dense grid has ep = 1; the expert grid has cp = 1, tp = --etp (default --tp) and
dp = world / (etp * ep * pp), and Megatron refuses a world that etp * ep * pp does not divide.
"""
from __future__ import annotations

import itertools
from math import prod

ORDER = ("tp", "cp", "ep", "dp", "pp")


def _digits(number: int, radices: list[int]) -> list[int]:
    """``number`` in the mixed radix ``radices`` (first digit fastest)."""
    out = []
    for radix in radices:
        number, digit = divmod(number, radix)
        out.append(digit)
    return out


def rank_groups(sizes: dict[str, int], axes: str) -> list[list[int]]:
    """The groups along ``axes`` (e.g. "tp-ep") of the grid with these per-axis ``sizes``, in Megatron's order."""
    inside = axes.split("-")
    strides = dict(zip(ORDER, itertools.accumulate([1] + [sizes[a] for a in ORDER[:-1]], lambda x, y: x * y)))
    along = [a for a in ORDER if a in inside]
    across = [a for a in ORDER if a not in inside]
    groups = []
    for g in range(prod(sizes[a] for a in across)):
        base = sum(d * strides[a] for a, d in zip(across, _digits(g, [sizes[a] for a in across])))
        groups.append([base + sum(d * strides[a] for a, d in zip(along, _digits(i, [sizes[a] for a in along])))
                       for i in range(prod(sizes[a] for a in along))])
    return groups


def dense_groups(tp: int, cp: int, dp: int, pp: int, axes: str) -> list[list[int]]:
    return rank_groups({"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}, axes)


def expert_groups(world: int, pp: int, ep: int, etp: int, axes: str) -> list[list[int]]:
    """The expert generator's groups ("tp" = expert-tensor, "ep", "dp" = expert-data, "pp")."""
    assert world % (etp * ep * pp) == 0, "Megatron raises here: world not divisible by etp * ep * pp"
    return rank_groups({"tp": etp, "cp": 1, "ep": ep, "dp": world // (etp * ep * pp), "pp": pp}, axes)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(max_world: int) -> list[tuple[int, int, int, int, int, int, int]]:
    """Every (world, tp, cp, dp, pp, etp, ep) with world <= ``max_world`` whose expert grid folds."""
    out = []
    for world in range(1, max_world + 1):
        for tp, cp, pp in itertools.product(divisors(world), repeat=3):
            if world % (tp * cp * pp):
                continue
            stage = world // pp
            out += [(world, tp, cp, world // (tp * cp * pp), pp, etp, ep)
                    for etp in divisors(stage) for ep in divisors(stage // etp)]
    return out
