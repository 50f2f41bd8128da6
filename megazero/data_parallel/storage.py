"""Where a buffer's parameters and main gradients live, chosen once per run from the ZeRO stage.

``storage_for`` is the one place the stage decides storage (as ``reduction.reduction_for`` decides the
reduction policy); every buffer of the run is built with the ``Storage`` it returns, and no storage
method asks the stage again:

    parameters  ReplicatedParams  ZeRO 0/1/2: one flat tensor holds every parameter; a bucket's shard is
                                  a view into it
                ShardedParams     ZeRO 3: a persistent parameter shard per bucket on the device, and per
                                  bucket a full-size tensor (``Bucket.param``) with a storage of its own
                                  that the parameters stay views of; ``free`` resizes that storage to 0
                                  bytes and ``materialize`` gives it its bytes back for an all-gather
                OffloadedParams   ZeRO 3 + --offload-params: as ShardedParams, but the shards live in a
                                  store (``param_offload.py``: host memory or a file); a gather fetches
                                  them, the step writes them back, ``close`` closes the store
    gradients   FullGrads         ZeRO 0/1: one persistent full-size main-grad buffer; a bucket's shard
                                  is a view into it (reduce-scatter runs in place)
                ShardedGrads      ZeRO 2/3: a persistent grad shard per bucket, and a full-size bucket
                                  gradient that exists only from the first gradient that reaches the
                                  bucket in a step (ZeRO 3, and ZeRO 2 with ``--reduce-every-micro-batch``:
                                  in a micro-batch) until its reduce-scatter has completed

Every parameter becomes a view into its storage (``attach_params``) and its gradient accumulates into a
view of a bucket gradient (``p.main_grad``, ``attach_grad``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from ..run_plan import ZeroStage
from .layout import Bucket
from .param_offload import DiskParamShards, Fetch, HostParamShards, Ready


def attach_params(b: Bucket, offsets: dict[nn.Parameter, int], param_b: torch.Tensor) -> None:
    """Copy every param of ``b`` into ``param_b`` [numel]; the model then computes with views into it."""
    for p in b.params:
        start = offsets[p] - b.offset
        view = param_b[start: start + p.numel()]
        view.copy_(p.data.reshape(-1))
        p.data = view.view_as(p)


def attach_grad(b: Bucket, offsets: dict[nn.Parameter, int], grad_b: torch.Tensor) -> None:
    """Point ``p.main_grad`` of every param of ``b`` into the bucket gradient ``grad_b`` [numel]."""
    b.grad = grad_b
    for p in b.params:
        start = offsets[p] - b.offset
        p.main_grad = grad_b[start: start + p.numel()].view_as(p)


class ParamStorage:
    """Where a buffer's parameters live; the variants are picked once per run (``storage_for``)."""

    deferred = False  # a fetch completes at once: a unit's all-gathers are issued with its fetches

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards

    @property
    def data(self) -> torch.Tensor | None:
        """Every parameter, flat (replicated storage only)."""
        return None

    @property
    def shard_data(self) -> torch.Tensor | None:
        """The persistent parameter shards, flat (ZeRO 3 on the device only)."""
        return None

    @property
    def store(self) -> HostParamShards | DiskParamShards | None:
        """Where the shards live between uses (ZeRO 3 + --offload-params only)."""
        return None

    def home(self, b: Bucket) -> int:
        """Where ``b``'s shard starts among the buckets' shards laid side by side."""
        return b.offset // self.num_shards

    def shard(self, b: Bucket) -> torch.Tensor:
        """This rank's parameter shard [shard_numel] of ``b``, in place (what the optimizer step updates)."""
        raise NotImplementedError

    def bucket(self, b: Bucket) -> torch.Tensor:
        """The full-size parameters [numel] of ``b``, with their bytes (an all-gather's output)."""
        raise NotImplementedError

    def materialize(self, b: Bucket) -> torch.Tensor:
        raise AssertionError("only ZeRO 3's sharded parameters are materialized and freed")

    def free(self, b: Bucket) -> None:
        raise AssertionError("only ZeRO 3's sharded parameters are materialized and freed")

    def read(self, b: Bucket) -> torch.Tensor:
        return self.shard(b)

    def fetch(self, b: Bucket) -> Fetch:
        """Start bringing ``b``'s shard to the device; ``.result()`` is the tensor (here: the shard itself)."""
        return Ready(self.shard(b))

    def write(self, b: Bucket, values: torch.Tensor, lo: int = 0) -> None:
        self.shard(b)[lo:lo + values.numel()].copy_(values)

    def flush(self) -> None:
        """Wait for writes still under way (only the disk tier has any)."""

    def close(self) -> None:
        """Release what this storage made (only the disk tier's file)."""


class ReplicatedParams(ParamStorage):
    """ZeRO 0/1/2: the flat ``data`` holds every parameter; a bucket's parameter shard is a view into it."""

    def __init__(self, buckets: list[Bucket], offsets: dict[nn.Parameter, int], num_shards: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_shards)
        # empty, not zeros: each page is first touched by the copy of a parameter whose own storage is
        # then freed, so building the buffer never holds two full copies of the model (only padding is zeroed)
        self.flat = torch.empty(sum(b.numel for b in buckets), dtype=dtype, device=device)
        for b in buckets:
            attach_params(b, offsets, self.flat[b.offset: b.offset + b.numel])
            self.flat[b.offset + sum(p.numel() for p in b.params): b.offset + b.numel].zero_()

    @property
    def data(self) -> torch.Tensor:
        return self.flat

    def shard(self, b: Bucket) -> torch.Tensor:
        return self.flat[b.shard_lo: b.shard_hi]

    def bucket(self, b: Bucket) -> torch.Tensor:
        return self.flat[b.offset: b.offset + b.numel]


class ParamShards(ParamStorage):
    """ZeRO 3: a persistent parameter shard per bucket (where: ``make_home``), and per bucket a full-size
    tensor (``b.param``) with a storage of its own that the parameters stay views of, holding bytes only
    while its unit is gathered."""

    def __init__(self, buckets: list[Bucket], offsets: dict[nn.Parameter, int], num_shards: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_shards)
        self.make_home(sum(b.numel for b in buckets) // num_shards, dtype, device)
        self.full: list[torch.Tensor] = []  # by bucket index: ``b.param``
        for b in buckets:
            b.param = torch.zeros(b.numel, dtype=dtype, device=device)
            self.full.append(b.param)
            attach_params(b, offsets, b.param)
            self.write(b, b.param[b.shard_lo - b.offset: b.shard_hi - b.offset])
            self.free(b)
        self.flush()

    def make_home(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate where the ``numel`` shard elements live between uses."""
        raise NotImplementedError

    def bucket(self, b: Bucket) -> torch.Tensor:
        return self.materialize(b)

    def materialize(self, b: Bucket) -> torch.Tensor:
        """Give ``b``'s full-size parameter storage its bytes back (contents undefined)."""
        full = self.full[b.index]
        storage = full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(b.numel * full.element_size())
        return full

    def free(self, b: Bucket) -> None:
        """Drop the full-size parameters of ``b``; the params keep their shapes but have no bytes."""
        self.full[b.index].untyped_storage().resize_(0)


class ShardedParams(ParamShards):
    """ZeRO 3: the shards live on the device, in ``shard_data``; a unit's all-gather reads them in place."""

    def make_home(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shards = torch.zeros(numel, dtype=dtype, device=device)

    @property
    def shard_data(self) -> torch.Tensor:
        return self.shards

    def shard(self, b: Bucket) -> torch.Tensor:
        return self.shards[self.home(b): self.home(b) + b.shard_numel]


class OffloadedParams(ParamShards):
    """ZeRO 3 + --offload-params: the shards live in a store (``param_offload.py``: host memory or a file);
    a gather fetches them, the step writes them back, ``close`` closes the store."""

    def __init__(self, buckets: list[Bucket], offsets: dict[nn.Parameter, int], num_shards: int,
                 dtype: torch.dtype, device: torch.device, *, make_store: Callable) -> None:
        self.make_store = make_store
        super().__init__(buckets, offsets, num_shards, dtype, device)

    def make_home(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shard_store: HostParamShards | DiskParamShards = self.make_store(numel, dtype, device)
        self.deferred = self.shard_store.deferred

    @property
    def store(self) -> HostParamShards | DiskParamShards:
        return self.shard_store

    def shard(self, b: Bucket) -> torch.Tensor:
        raise AssertionError("offloaded shards: use read/fetch/set_param_shard")

    def read(self, b: Bucket) -> torch.Tensor:
        return self.shard_store.read(self.home(b), b.shard_numel)

    def fetch(self, b: Bucket) -> Fetch:
        return self.shard_store.fetch(self.home(b), b.shard_numel)

    def write(self, b: Bucket, values: torch.Tensor, lo: int = 0) -> None:
        self.shard_store.write(self.home(b) + lo, values)

    def flush(self) -> None:
        self.shard_store.flush()

    def close(self) -> None:
        self.shard_store.close()


class GradStorage:
    """Where a buffer's main gradients live; the variants are picked once per run (``storage_for``)."""

    @property
    def data(self) -> torch.Tensor | None:
        """The full main-grad buffer (ZeRO 0/1 only)."""
        return None

    @property
    def shard_data(self) -> torch.Tensor | None:
        """The persistent grad shards, flat (ZeRO 2/3 only)."""
        return None

    def bucket(self, b: Bucket) -> torch.Tensor:
        """The full-size gradient [numel] of ``b`` that the gradient hooks accumulate into."""
        raise NotImplementedError

    def release(self, b: Bucket) -> None:
        """``b``'s shard has been reduced out of its full-size gradient."""

    def shard(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced-gradient shard [shard_numel] of ``b``."""
        raise NotImplementedError

    def zero(self) -> None:
        """A step starts: the persistent gradients restart from zero."""
        raise NotImplementedError


class FullGrads(GradStorage):
    """ZeRO 0/1: one persistent full-size main-grad buffer; a bucket's shard is a view into it (reduce-scatter
    runs in place), and every bucket keeps its gradient view for the whole run."""

    def __init__(self, buckets: list[Bucket], offsets: dict[nn.Parameter, int], num_shards: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.full = torch.zeros(sum(b.numel for b in buckets), dtype=dtype, device=device)
        self.views = [self.full[b.offset: b.offset + b.numel] for b in buckets]  # by bucket index
        for b, view in zip(buckets, self.views):
            attach_grad(b, offsets, view)

    @property
    def data(self) -> torch.Tensor:
        return self.full

    def bucket(self, b: Bucket) -> torch.Tensor:
        return self.views[b.index]

    def shard(self, b: Bucket) -> torch.Tensor:
        return self.full[b.shard_lo: b.shard_hi]

    def zero(self) -> None:
        self.full.zero_()


class ShardedGrads(GradStorage):
    """ZeRO 2/3: a persistent grad shard per bucket, and a full-size bucket gradient that exists only from the
    first gradient that reaches the bucket in a step (ZeRO 3, and ZeRO 2 with ``--reduce-every-micro-batch``:
    in a micro-batch) until its reduce-scatter has completed (``release``)."""

    def __init__(self, buckets: list[Bucket], offsets: dict[nn.Parameter, int], num_shards: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.offsets, self.num_shards, self.dtype, self.device = offsets, num_shards, dtype, device
        self.shards = torch.zeros(sum(b.numel for b in buckets) // num_shards, dtype=dtype, device=device)

    @property
    def shard_data(self) -> torch.Tensor:
        return self.shards

    def bucket(self, b: Bucket) -> torch.Tensor:
        if b.grad is not None:
            return b.grad
        grad_b = torch.zeros(b.numel, dtype=self.dtype, device=self.device)  # the bucket's first gradient
        attach_grad(b, self.offsets, grad_b)
        return grad_b

    def release(self, b: Bucket) -> None:
        b.grad = None
        for p in b.params:
            p.main_grad = None

    def shard(self, b: Bucket) -> torch.Tensor:
        lo = b.offset // self.num_shards
        return self.shards[lo: lo + b.shard_numel]

    def zero(self) -> None:  # reducing every micro-batch adds each one's share into the shard
        self.shards.zero_()


@dataclass(frozen=True)
class Storage:
    """How every buffer of a run stores its parameters and its gradients (``storage_for``); each is called
    ``(buckets, offsets, num_shards, dtype, device)``."""

    params: Callable[..., ParamStorage]
    grads: Callable[..., GradStorage]


def storage_for(stage: ZeroStage, param_store: Callable | None = None) -> Storage:
    """The one place the ZeRO stage decides storage, once per run, as ``reduction.reduction_for`` decides the
    reduction: parameters replicated below ZeRO 3, else sharded on the device or, given ``param_store``
    (``param_offload.param_shard_factory``), offloaded; gradients full below ZeRO 2, else sharded."""
    if not stage.shards_parameters:
        params: Callable[..., ParamStorage] = ReplicatedParams
    elif param_store is None:
        params = ShardedParams
    else:
        params = partial(OffloadedParams, make_store=param_store)
    return Storage(params, ShardedGrads if stage.shards_gradients else FullGrads)
