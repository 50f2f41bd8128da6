"""ZeRO 3's model state at its high-water mark in a step, replayed unit by unit.

Persistent, per rank (``data_parallel/buffers.py``): the parameter shard and the
gradient shard, each 1/dp of the chunk's *padded* buckets (ZeRO 3 closes a
bucket at every unit boundary, so there are more buckets, each padded to
dp x 16 elements), and the optimizer state on the same shard (K = 8 bytes per
element in fp32, where the parameter shard is the master; 12 otherwise): the
ZeRO paper's (w + g + K) / dp, 16 / dp with bf16 main grads.

Transient, what ``data_parallel/zero3.py`` and ``data_parallel/engine.py`` hold at a moment:

    gathered units  the full-size buckets of the units gathered (w bytes per element):
                    the chunk's root unit (embeddings, final norm, head) from its forward
                    until its last gradient arrives (the embedding's, at the end of the
                    backward; on a last stage without the embedding, the head's, at its
                    start); with reshard-after-forward, in forward
                    unit k and the ``prefetch`` next ones, in backward unit k and the
                    ``prefetch`` previous ones (the head's backward: the root and the last
                    ``prefetch`` blocks; a unit is freed once its gradients have
                    accumulated, before the previous unit's backward starts); without it,
                    every block unit from its forward to its backward. Under pipelining a
                    kept unit (the root; every unit without resharding) stays gathered
                    while any micro-batch is in flight on the stage, so when a stage holds
                    more than one (``pinned``) the roots (and without resharding the whole
                    chunk) stay gathered, with interleaving those of every chunk.
    bucket grads    during backward, each bucket's full-size gradient from its first
                    gradient to the retiring of its reduce-scatter, plus the temporary
                    1/dp shard that reduce-scatter writes: at most MAX_INFLIGHT_BUCKETS
                    reducing and one filling, the newest one's shard allocated before the
                    oldest retires. A callback at the end of each backward retires the rest,
                    so nothing of one backward lives on into the next forward.
    step copies     main grads not fp32: ``step()`` casts every reduced shard to fp32 while
                    nothing is gathered (``finish()`` freed every unit).

The replay walks one chunk's forward (unit by unit) and backward (bucket by bucket,
in the engine's order) and takes the moment where gathered parameters plus
transient gradients are largest; ``params`` and ``grads`` are both counted at
that moment, so their sum with the optimizer state is the peak (each alone may
peak elsewhere). An upper bound where the engine may do better: a reduction that
finishes early frees its bucket at the next launch.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..data_parallel.engine import MAX_INFLIGHT_BUCKETS
from ..run_plan import UnitGathering

Buckets = list[tuple[int, int]]  # (unit, padded elements) in backward order; unit 0 is the root


@dataclass(frozen=True)
class PeakState:
    params: float  # parameter shard + units gathered at the peak
    grads: float  # gradient shard + bucket gradients, their partial shards or the step's fp32 copies at the peak
    optimizer: float
    persistent: float  # the shards alone: (w + g + K) / dp of the padded buckets
    params_peak: float = 0.0  # the most parameter bytes held at any moment (may be another moment than the peak)


def _unit_sizes(buckets: Buckets) -> dict[int, int]:
    sizes: dict[int, int] = {}
    for unit, n in buckets:
        sizes[unit] = sizes.get(unit, 0) + n
    return sizes


def _forward_gathered(sizes: dict[int, int], gathering: UnitGathering, pinned: bool) -> int:
    """Most elements of this chunk gathered during its forward."""
    blocks = sorted(u for u in sizes if u > 0)
    if pinned or not gathering.reshard_after_forward or not blocks:
        return sum(sizes.values())
    window = max(sum(sizes[v] for v in blocks if k <= v <= k + gathering.prefetch) for k in blocks)
    return sizes.get(0, 0) + window


def _backward_gathered(sizes: dict[int, int], unit: int, past_blocks: bool, gathering: UnitGathering,
                       pinned: bool, root_gathered: bool) -> int:
    """Elements of this chunk gathered while a bucket of ``unit`` fills (``past_blocks``: a root bucket
    after the blocks', i.e. the embedding's, not the head's; ``root_gathered``: the root unit is freed
    once its last gradient has arrived, unless another micro-batch still needs it)."""
    root = sizes.get(0, 0) if root_gathered else 0
    if pinned:
        return sum(sizes.values())
    if unit == 0:  # the embedding's buckets come after every block is freed
        if past_blocks:
            return root
        if not gathering.reshard_after_forward:  # the head's: every block is still gathered
            return root + sum(n for v, n in sizes.items() if v > 0)
        blocks = sorted(v for v in sizes if v > 0)  # the root's backward prefetched the last ones
        return root + sum(sizes[v] for v in blocks[len(blocks) - gathering.prefetch:] if gathering.prefetch)
    if not gathering.reshard_after_forward:
        return root + sum(n for v, n in sizes.items() if 0 < v <= unit)
    return root + sum(n for v, n in sizes.items() if max(1, unit - gathering.prefetch) <= v <= unit)


def _chunk_moments(buckets: Buckets, sizes: dict[int, int], held, depth: int, gathering: UnitGathering,
                   pinned: bool, roots_pinned: bool) -> list[tuple[int, int]]:
    """(gathered, transient gradient) elements of one chunk's forward and of each bucket of its backward."""
    moments = [(_forward_gathered(sizes, gathering, pinned), 0)]
    seq = [n for _, n in buckets]
    past_blocks, last_root = False, max((j for j, (u, _) in enumerate(buckets) if u == 0), default=-1)
    for j, (unit, _) in enumerate(buckets):
        past_blocks = past_blocks or unit > 0
        window = seq[max(0, j + 1 - depth): j + 1]
        gathered = _backward_gathered(sizes, unit, past_blocks and unit == 0, gathering, pinned,
                                      root_gathered=roots_pinned or j <= last_root)
        moments.append((gathered, sum(held(n) for n in window)))
    return moments


def zero3_bytes(chunks: list[Buckets], dp: int, w: int, g: int, k: int, gathering: UnitGathering,
                pinned: bool) -> PeakState:
    """Model-state bytes of one rank at ZeRO 3's high-water mark (see the module docstring).

    ``chunks``: this rank's chunks as ``unit_buckets`` cuts them, in the order their gradients
    arrive; ``w``, ``g``, ``k``: bytes per element of parameters, main grads and optimizer state;
    ``pinned``: more than one micro-batch is in flight on this stage (kept units stay gathered:
    the roots, and every unit without resharding).
    """
    shard = sum(n for c in chunks for _, n in c) // dp
    depth = MAX_INFLIGHT_BUCKETS + 1 if dp > 1 else 1  # dp = 1 adds into the shard at once, nothing in flight

    def held(n: int) -> int:  # a bucket in flight: its full-size gradient and its partial shard
        return n + (n // dp if dp > 1 else 0)

    sizes = [_unit_sizes(c) for c in chunks]
    roots_pinned, pinned = pinned, pinned and not gathering.reshard_after_forward  # resharded blocks are freed
    moments: list[tuple[int, int]] = []  # (gathered elements, transient gradient elements)
    for c, buckets in enumerate(chunks):
        others = sum(sum(s.values()) if pinned else s.get(0, 0) for i, s in enumerate(sizes) if i != c)
        moments += [(others + gathered, transient) for gathered, transient in
                    _chunk_moments(buckets, sizes[c], held, depth, gathering, pinned, roots_pinned)]
    gathered, transient = max(moments, key=lambda m: m[0] * w + m[1] * g)
    params, grads = (shard + gathered) * w, (shard + transient) * g
    if g != 4 and shard * (w + g + 4) > params + grads:  # step(): fp32 copies of the shard, nothing gathered
        params, grads = shard * w, shard * (g + 4)
    return PeakState(params=params, grads=grads, optimizer=shard * k, persistent=shard * (w + g + k),
                     params_peak=(shard + max(m[0] for m in moments)) * w)
