"""THE bucket rule, as one pure function on element counts: the buffers (``layout.plan_buckets``) cut
their buckets with it, and the memory planner (``memory/grads.py``) predicts the same buckets from the
parameter counts alone, so what the planner charges is the buffers' real cut.

The rule, over the parameters in buffer order (reverse registration: roughly the order backward
produces their gradients):
- a bucket closes once its parameters reach ``bucket_size`` elements (whole parameters only);
- a tied word embedding sits alone in its bucket, so the first and last pipeline stages shard it
  identically and can sum their shards over the embedding group;
- ZeRO 3: a bucket never holds parameters of two units (a unit gathers whole buckets);
- each bucket is padded to a multiple of ``num_shards x PAD_ALIGN`` elements, so every shard is an
  equal, aligned slice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PAD_ALIGN = 16  # elements: keeps every shard 32/64-byte aligned for bf16/fp32 kernels


@dataclass(frozen=True)
class BucketCut:
    """Parameters ``[start, stop)`` (buffer order) in one bucket of ``numel`` padded elements."""

    start: int
    stop: int
    numel: int
    unit: int | None  # ZeRO 3: the unit all its parameters belong to


def cut_buckets(numels: Sequence[int], bucket_size: int, num_shards: int, *,
                tied: Sequence[bool] | None = None, units: Sequence[int] | None = None) -> list[BucketCut]:
    """The buckets of parameters with ``numels`` elements, given in buffer order.

    ``tied[i]``: parameter i is a tied word embedding (alone in its bucket); ``units[i]``: its ZeRO-3 unit.
    """
    align = num_shards * PAD_ALIGN
    cuts: list[BucketCut] = []
    start, pending = 0, 0

    def close(stop: int) -> None:
        nonlocal start, pending
        if stop > start:
            unit = None if units is None else units[start]
            cuts.append(BucketCut(start, stop, -(-pending // align) * align, unit))
        start, pending = stop, 0

    for i, n in enumerate(numels):
        alone = tied is not None and tied[i]
        if alone or (units is not None and units[i] != units[start]):
            close(i)
        pending += n
        if alone or pending >= bucket_size:
            close(i + 1)
    close(len(numels))
    return cuts
