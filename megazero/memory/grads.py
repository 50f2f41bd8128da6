"""Gradient bytes the ZeRO optimizer holds at its high-water mark in a step.

The persistent gradient storage is what ``optimizer/buffers.py`` allocates at
build time: the full main-grad buffer under ZeRO 0/1, the 1/dp shard under
ZeRO 2. On top of it, during a step, the optimizer holds (``optimizer/grad_sync.py``):

    ZeRO 2, m > 1   every bucket's full-size gradient, from the first micro-batch's
                    backward until the last one reduce-scatters it: a full-size
                    gradient buffer during accumulation (P g), plus the shard.
    ZeRO 2, m = 1   the full-size buckets in flight: at most MAX_INFLIGHT_BUCKETS
                    reducing plus the one filling, consecutive in backward order;
                    the planner charges the largest such window of real buckets
                    (an upper bound: a reduction that finishes early frees its bucket;
                    with interleaved chunks, the largest buckets of any chunk).
    step            main grads in bf16: ``step()`` casts every reduced shard to fp32
                    (4 bytes x the shard elements) while the persistent buffer lives.

The peak is the persistent storage plus the larger of the backward and step terms.
Buckets are cut exactly as ``plan_buckets`` cuts them (``chunk_param_numels``
gives the parameters in order), so the in-flight window is the real one.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..optimizer.buffers import PAD_ALIGN
from ..optimizer.grad_sync import MAX_INFLIGHT_BUCKETS


@dataclass(frozen=True)
class GradBytes:
    persistent: float  # main-grad buffer (ZeRO 0/1) or grad shard (ZeRO 2)
    backward: float  # ZeRO 2: full-size bucket gradients alive during backward
    step: float  # fp32 copies of the reduced shards during step() (main grads not fp32)

    @property
    def peak(self) -> float:
        return self.persistent + max(self.backward, self.step)


def bucket_numels(numels: list[int], bucket_size: int, num_shards: int, tied_first: bool) -> list[int]:
    """Padded bucket sizes in backward order for parameters given in registration order.

    The rule of ``optimizer.buffers.plan_buckets``: parameters in reverse order, a bucket
    closes once it reaches ``bucket_size`` elements, a tied word embedding (``tied_first``:
    the first registered parameter) sits alone, and each bucket is padded to a multiple of
    ``num_shards x PAD_ALIGN``.
    """
    return [n for _, n in unit_buckets(numels, [0] * len(numels), bucket_size, num_shards, tied_first)]


def unit_buckets(numels: list[int], units: list[int], bucket_size: int, num_shards: int,
                 tied_first: bool) -> list[tuple[int, int]]:
    """(unit, padded size) of every bucket in backward order: ``bucket_numels`` with ZeRO 3's extra
    rule that a bucket never holds parameters of two units (``units``: each parameter's unit)."""
    align = num_shards * PAD_ALIGN
    out: list[tuple[int, int]] = []
    pending, unit = 0, None
    for i, (n, u) in enumerate(zip(reversed(numels), reversed(units))):
        tied = tied_first and i == len(numels) - 1
        if pending and (tied or u != unit):
            out.append((unit, pending))
            pending = 0
        pending, unit = pending + n, u
        if tied or pending >= bucket_size:
            out.append((unit, pending))
            pending = 0
    if pending:
        out.append((unit, pending))
    return [(u, -(-b // align) * align) for u, b in out]


def inflight_numel(buckets: list[int]) -> int:
    """The most elements held by MAX_INFLIGHT_BUCKETS + 1 consecutive buckets (ZeRO 2, one micro-batch)."""
    k = MAX_INFLIGHT_BUCKETS + 1
    if len(buckets) <= k:
        return sum(buckets)
    return max(sum(buckets[i: i + k]) for i in range(len(buckets) - k + 1))


def grad_bytes(params: int, chunk_buckets: list[list[int]], dp: int, zero: int, num_micro_batches: int,
               grad_bytes_per_param: int) -> GradBytes:
    """Gradient bytes on one rank holding ``params`` parameters in chunks bucketed as ``chunk_buckets``."""
    g = grad_bytes_per_param
    shard = params / dp if zero >= 1 else params
    step = 4 * shard if g != 4 else 0.0
    if zero < 2:
        return GradBytes(persistent=params * g, backward=0.0, step=step)
    if num_micro_batches > 1:
        backward = params * g
    elif len(chunk_buckets) == 1:
        backward = inflight_numel(chunk_buckets[0]) * g
    else:  # interleaved chunks: backward order across chunks varies, so charge the largest buckets
        backward = sum(sorted((n for b in chunk_buckets for n in b), reverse=True)[:MAX_INFLIGHT_BUCKETS + 1]) * g
    return GradBytes(persistent=params * g / dp, backward=backward, step=step)
