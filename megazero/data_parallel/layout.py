"""The layout of one model chunk's flat buffers: buckets, this rank's shard of each, and the pieces of
parameters in a shard.

Parameters are laid out in *reverse* registration order, which is roughly the order backward produces
their gradients, so buckets fill one after another and their communication can start while backward
continues. Buckets (``bucketing.cut_buckets``: the one bucket rule) hold whole parameters and are padded
to a multiple of ``num_shards`` (the reduction group's size under ZeRO 1/2/3, else 1) so every rank owns
an equal, contiguous 1/num_shards slice of each bucket: its *shard*. A ``Segment`` is the piece of one
parameter inside this rank's shard (what the optimizer step reads per parameter: decay, replicated sums).
Where the bytes live is ``storage.py``'s concern; this module only places them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..tensor_parallel.layers import spec_of
from .bucketing import cut_buckets


@dataclass
class Segment:
    """The piece of one parameter inside this rank's shard of a bucket.

    ``shard[lo:hi]`` holds ``param.view(-1)[param_lo : param_lo + hi - lo]``.
    """

    param: nn.Parameter
    lo: int
    hi: int
    param_lo: int

    @property
    def decay(self) -> bool:
        return spec_of(self.param).weight_decay

    @property
    def tp_sync(self) -> bool:
        return spec_of(self.param).sequence_parallel

    @property
    def emb_sync(self) -> bool:
        return spec_of(self.param).tied_role is not None


def merged_runs(segments: list[Segment], keep: Callable[[Segment], bool]) -> list[tuple[int, int]]:
    """Shard ranges [lo, hi) of the segments ``keep`` selects, adjacent ones merged."""
    runs: list[tuple[int, int]] = []
    for seg in segments:
        if not keep(seg):
            continue
        if runs and runs[-1][1] == seg.lo:
            runs[-1] = (runs[-1][0], seg.hi)
        else:
            runs.append((seg.lo, seg.hi))
    return runs


@dataclass
class Bucket:
    """Whole parameters occupying ``[offset, offset + numel)`` of the chunk's buffers."""

    index: int
    params: list[nn.Parameter]
    offset: int
    numel: int
    shard_lo: int  # this rank's shard, in buffer coordinates
    shard_hi: int
    segments: list[Segment] = field(default_factory=list)
    ready: int = 0  # params whose grads arrived in the current backward
    launched: bool = False  # gradient communication issued this step
    grad: torch.Tensor | None = None  # full-size bucket gradient (transient under ZeRO 2/3)
    param: torch.Tensor | None = None  # ZeRO 3: full-size parameters, own storage (0 bytes while freed)

    @property
    def shard_numel(self) -> int:
        return self.shard_hi - self.shard_lo


def plan_buckets(params: list[nn.Parameter], bucket_size: int, num_shards: int, shard_rank: int,
                 unit_of: dict[nn.Parameter, int] | None = None) -> tuple[list[Bucket], dict[nn.Parameter, int]]:
    """Group params (already in buffer order) into padded buckets (``bucketing.cut_buckets``); returns
    buckets and param offsets. With ``unit_of`` (ZeRO 3) a bucket never holds parameters of two units."""
    cuts = cut_buckets([p.numel() for p in params], bucket_size, num_shards,
                       tied=[spec_of(p).tied_role is not None for p in params],
                       units=None if unit_of is None else [unit_of[p] for p in params])
    buckets: list[Bucket] = []
    offsets: dict[nn.Parameter, int] = {}
    cursor = 0
    for cut in cuts:
        shard = cut.numel // num_shards
        b = Bucket(index=len(buckets), params=params[cut.start:cut.stop], offset=cursor, numel=cut.numel,
                   shard_lo=cursor + shard_rank * shard, shard_hi=cursor + (shard_rank + 1) * shard)
        at = cursor
        for p in b.params:
            offsets[p], at = at, at + p.numel()
        buckets.append(b)
        cursor += cut.numel
    for b in buckets:
        for p in b.params:
            lo, hi = max(offsets[p], b.shard_lo), min(offsets[p] + p.numel(), b.shard_hi)
            if lo < hi:
                b.segments.append(Segment(p, lo - b.shard_lo, hi - b.shard_lo, lo - offsets[p]))
    return buckets, offsets
