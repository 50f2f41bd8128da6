"""Contiguous parameter and gradient buffers for one model chunk, split into buckets.

Every trainable parameter of a chunk becomes a view into one flat
``param_data`` tensor (compute dtype), and its gradient accumulates into a
view of a flat main-grad tensor (``p.main_grad``, fp32 or bf16). Parameters
are laid out in *reverse* registration order, which is roughly the order
backward produces their gradients, so buckets fill one after another and
their communication can start while backward continues.

Buckets (``bucketing.cut_buckets``: the one bucket rule) hold whole parameters
and are padded to a multiple of ``num_shards`` (the reduction group's size under
ZeRO 1/2/3, else 1) so every rank owns an equal, contiguous 1/num_shards slice
of each bucket: its *shard*. A tied word embedding gets a bucket of its own, so
the first and last pipeline stage shard it identically and can sum their shards
over the embedding group. A chunk's mixture-of-experts expert weights (``ParamSpec.expert``)
fill a buffer of their own (``expert``), sharded over the expert-data-parallel group.

Gradient storage depends on the ``ZeroStage`` (``stage``):
- not ``shards_gradients`` (ZeRO 0/1): one persistent full-size grad buffer;
  a bucket's shard is a view into it (reduce-scatter runs in place).
- ``shards_gradients`` (ZeRO 2/3): a persistent grad *shard* per bucket, and
  a full-size bucket gradient that exists only from the first gradient that
  reaches the bucket in a step (ZeRO 3, and ZeRO 2 with
  ``--reduce-every-micro-batch``: in a micro-batch) until its reduce-scatter
  has completed.

Parameter storage likewise:
- not ``shards_parameters`` (ZeRO 0/1/2): the flat ``param_data`` holds every
  parameter; a bucket's parameter shard is a view into it.
- ``shards_parameters`` (ZeRO 3): a persistent parameter *shard* per bucket
  (``param_shard_data``), and per bucket a full-size tensor with a storage of
  its own that the parameters stay views of; ``free_params`` resizes that
  storage to 0 bytes and ``materialize_params`` gives it its bytes back for an
  all-gather to fill. ``unit_of`` closes buckets at ZeRO-3 unit boundaries, so
  a unit gathers whole buckets. With ``--offload-params`` the shards live in a
  ``param_store`` (``param_offload.py``: host memory or a file) instead of
  ``param_shard_data``; a gather fetches them, the step writes them back. The
  buffer makes its store (``param_store``: a factory) and closes it (``close``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..run_plan import ZeroStage
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


class ParamGradBuffer:
    """Flat storage for one chunk's parameters and main gradients (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter], *, bucket_size: int, num_shards: int, shard_rank: int,
                 param_dtype: torch.dtype, grad_dtype: torch.dtype, stage: ZeroStage, device: torch.device,
                 unit_of: dict[nn.Parameter, int] | None = None, param_store: Callable | None = None,
                 expert: bool = False) -> None:
        self.params = list(reversed(params))  # backward order
        self.expert = expert  # holds expert weights: reduced and sharded over the expert-data-parallel group
        self.num_shards, self.grad_dtype, self.param_dtype, self.stage = num_shards, grad_dtype, param_dtype, stage
        self.buckets, self.offsets = plan_buckets(self.params, bucket_size, num_shards, shard_rank, unit_of)
        self.numel = sum(b.numel for b in self.buckets)
        self.device = device
        self.param_data: torch.Tensor | None = None  # every parameter (ZeRO 0/1/2)
        self.param_shard_data: torch.Tensor | None = None  # persistent parameter shards (ZeRO 3)
        self.param_store = None  # ZeRO 3 + --offload-params: where the shards live (made here, closed by close())
        if stage.shards_parameters:
            if param_store is None:
                self.param_shard_data = torch.zeros(self.numel // num_shards, dtype=param_dtype, device=device)
            else:
                self.param_store = param_store(self.numel // num_shards, param_dtype, device)
            for b in self.buckets:
                b.param = torch.zeros(b.numel, dtype=param_dtype, device=device)
                self._attach_params(b, b.param)
                self.set_param_shard(b, b.param[b.shard_lo - b.offset: b.shard_hi - b.offset])
                self.free_params(b)
            self.flush_param_shards()
        else:
            # empty, not zeros: each page is first touched by the copy of a parameter whose own storage is
            # then freed, so building the buffer never holds two full copies of the model (only padding is zeroed)
            self.param_data = torch.empty(self.numel, dtype=param_dtype, device=device)
            for b in self.buckets:
                self._attach_params(b, self.param_data[b.offset: b.offset + b.numel])
                self.param_data[b.offset + sum(p.numel() for p in b.params): b.offset + b.numel].zero_()
        self.grad_data: torch.Tensor | None = None  # full main-grad buffer (ZeRO 0/1)
        self.grad_shard_data: torch.Tensor | None = None  # persistent grad shards (ZeRO 2/3)
        if stage.shards_gradients:
            self.grad_shard_data = torch.zeros(self.numel // num_shards, dtype=grad_dtype, device=device)
        else:
            self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
            for b in self.buckets:
                self._attach_grad(b, self.grad_data[b.offset: b.offset + b.numel])

    def _attach_params(self, b: Bucket, param_b: torch.Tensor) -> None:
        """Copy every param of ``b`` into ``param_b`` [numel]; the model then computes with views into it."""
        for p in b.params:
            start = self.offsets[p] - b.offset
            view = param_b[start: start + p.numel()]
            view.copy_(p.data.reshape(-1))
            p.data = view.view_as(p)

    def materialize_params(self, b: Bucket) -> torch.Tensor:
        """ZeRO 3: give bucket ``b``'s full-size parameter storage its bytes back (contents undefined)."""
        storage = b.param.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(b.numel * b.param.element_size())
        return b.param

    def free_params(self, b: Bucket) -> None:
        """ZeRO 3: drop the full-size parameters of ``b``; the params keep their shapes but have no bytes."""
        b.param.untyped_storage().resize_(0)

    def _attach_grad(self, b: Bucket, grad_b: torch.Tensor) -> None:
        """Point ``p.main_grad`` of every param of ``b`` into the bucket gradient ``grad_b`` [numel]."""
        b.grad = grad_b
        for p in b.params:
            start = self.offsets[p] - b.offset
            p.main_grad = grad_b[start: start + p.numel()].view_as(p)

    def bucket_grad(self, b: Bucket) -> torch.Tensor:
        """The full-size gradient [numel] of bucket ``b``; allocated (zeros) on demand under ZeRO 2."""
        if b.grad is None:
            assert self.stage.shards_gradients, "ZeRO 0/1 buckets keep their gradient views for the whole run"
            self._attach_grad(b, torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device))
        return b.grad

    def release(self, b: Bucket) -> None:
        """ZeRO 2/3: drop the full-size bucket gradient once its shard has been reduced out of it."""
        if self.stage.shards_gradients:
            b.grad = None
            for p in b.params:
                p.main_grad = None

    def grad_shard(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced-gradient shard [shard_numel] of bucket ``b``."""
        if self.stage.shards_gradients:
            lo = b.offset // self.num_shards
            return self.grad_shard_data[lo: lo + b.shard_numel]
        return self.grad_data[b.shard_lo: b.shard_hi]

    def param_shard(self, b: Bucket) -> torch.Tensor:
        """This rank's parameter shard [shard_numel] of bucket ``b`` (what the optimizer step updates)."""
        if self.stage.shards_parameters:
            assert self.param_store is None, "offloaded shards: use read/fetch/set_param_shard"
            lo = b.offset // self.num_shards
            return self.param_shard_data[lo: lo + b.shard_numel]
        return self.param_data[b.shard_lo: b.shard_hi]

    def read_param_shard(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s parameter shard wherever it lives (offloaded to disk: a copy read back)."""
        if self.param_store is None:
            return self.param_shard(b)
        return self.param_store.read(b.offset // self.num_shards, b.shard_numel)

    def fetch_param_shard(self, b: Bucket):
        """--offload-params: start bringing ``b``'s shard to the device; ``.result()`` is the tensor."""
        return self.param_store.fetch(b.offset // self.num_shards, b.shard_numel)

    def set_param_shard(self, b: Bucket, values: torch.Tensor, lo: int = 0) -> None:
        """Store updated shard elements [lo, lo + n) ``values`` (cast to the parameter dtype) where ``b``'s
        shard lives (the disk-offloaded optimizer may update a shard in pieces)."""
        if self.param_store is None:
            self.param_shard(b)[lo:lo + values.numel()].copy_(values)
        else:
            self.param_store.write(b.offset // self.num_shards + lo, values)

    def flush_param_shards(self) -> None:
        """--offload-params disk: wait for the write-behind of updated shards (errors surface here)."""
        if self.param_store is not None:
            self.param_store.flush()

    def param_bucket(self, b: Bucket) -> torch.Tensor:
        """The full-size parameters [numel] of bucket ``b`` (ZeRO 3: materialized first)."""
        if self.stage.shards_parameters:
            return self.materialize_params(b)
        return self.param_data[b.offset: b.offset + b.numel]

    def zero_grad(self) -> None:
        """Start a step: accumulation restarts from zero and no bucket has communicated."""
        if self.grad_data is not None:
            self.grad_data.zero_()
        if self.grad_shard_data is not None:  # reducing every micro-batch adds each one's share into the shard
            self.grad_shard_data.zero_()
        for b in self.buckets:
            b.ready, b.launched = 0, False
            self.release(b)

    def close(self) -> None:
        """Release the parameter-shard store this buffer made (the disk tier removes its file)."""
        if self.param_store is not None:
            self.param_store.close()
