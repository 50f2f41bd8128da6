"""Gradient bytes the ZeRO optimizer holds at its high-water mark in a step.

The persistent gradient storage is what ``data_parallel/storage.py`` allocates at
build time: the full main-grad buffer under ZeRO 0/1, the 1/dp shard under
ZeRO 2. On top of it, during a step, the optimizer holds (``data_parallel/engine.py``):

    ZeRO 2, m > 1   (reducing once per step, the default) every bucket's full-size
                    gradient, from the first micro-batch's backward until the last one
                    reduce-scatters it: a full-size gradient buffer during accumulation
                    (P g), plus the shard.
    ZeRO 2, m = 1,  the full-size buckets in flight: at most MAX_INFLIGHT_BUCKETS
    or every micro-batch (--reduce-every-micro-batch: each backward reduce-scatters
                    in place and frees its buckets before the next forward)
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

from ..data_parallel.bucketing import cut_buckets
from ..data_parallel.engine import MAX_INFLIGHT_BUCKETS
from ..run_plan import GradReduction, ZeroStage


@dataclass(frozen=True)
class GradBytes:
    persistent: float  # main-grad buffer (ZeRO 0/1) or grad shard (ZeRO 2)
    backward: float  # ZeRO 2: full-size bucket gradients alive during backward
    step: float  # fp32 copies of the reduced shards during step() (main grads not fp32)

    @property
    def peak(self) -> float:
        return self.persistent + max(self.backward, self.step)


def bucket_numels(numels: list[int], bucket_size: int, num_shards: int, tied_first: bool) -> list[int]:
    """Padded bucket sizes in backward order for parameters given in registration order
    (``data_parallel.bucketing.cut_buckets``, the rule the buffers cut with; ``tied_first``: the first
    registered parameter is a tied word embedding)."""
    return [n for _, n in unit_buckets(numels, [0] * len(numels), bucket_size, num_shards, tied_first)]


def unit_buckets(numels: list[int], units: list[int], bucket_size: int, num_shards: int,
                 tied_first: bool) -> list[tuple[int, int]]:
    """(unit, padded size) of every bucket in backward order: ``bucket_numels`` with ZeRO 3's extra
    rule that a bucket never holds parameters of two units (``units``: each parameter's unit)."""
    tied = [tied_first and i == len(numels) - 1 for i in range(len(numels))]
    cuts = cut_buckets(numels[::-1], bucket_size, num_shards, tied=tied, units=units[::-1])
    return [(c.unit, c.numel) for c in cuts]


def inflight_numel(buckets: list[int]) -> int:
    """The most elements held by MAX_INFLIGHT_BUCKETS + 1 consecutive buckets (ZeRO 2, one micro-batch)."""
    k = MAX_INFLIGHT_BUCKETS + 1
    if len(buckets) <= k:
        return sum(buckets)
    return max(sum(buckets[i: i + k]) for i in range(len(buckets) - k + 1))


def grad_bytes(params: int, chunk_buckets: list[list[int]], dp: int, zero: int | ZeroStage, num_micro_batches: int,
               grad_bytes_per_param: int, reduction: GradReduction = GradReduction.ONCE_PER_STEP) -> GradBytes:
    """Gradient bytes on one rank holding ``params`` parameters in chunks bucketed as ``chunk_buckets``
    (``reduction``: when ZeRO 2 reduces them, the run plan's ``grad_reduction``)."""
    g, z = grad_bytes_per_param, ZeroStage(zero)
    shard = params / dp if z.shards_optimizer_state else params
    step = 4 * shard if g != 4 else 0.0
    if not z.shards_gradients:
        return GradBytes(persistent=params * g, backward=0.0, step=step)
    if num_micro_batches > 1 and reduction.keeps_full_grads:
        backward = params * g
    elif len(chunk_buckets) == 1:
        backward = inflight_numel(chunk_buckets[0]) * g
    else:  # interleaved chunks: backward order across chunks varies, so charge the largest buckets
        backward = sum(sorted((n for b in chunk_buckets for n in b), reverse=True)[:MAX_INFLIGHT_BUCKETS + 1]) * g
    return GradBytes(persistent=params * g / dp, backward=backward, step=step)
