"""Contiguous parameter and gradient buffers for one model chunk, split into buckets.

Every trainable parameter of a chunk becomes a view into one flat storage
(compute dtype), and its gradient accumulates into a view of a flat main-grad
tensor (``p.main_grad``, fp32 or bf16). The buckets, this rank's shard of each
and the parameter pieces in a shard are the layout (``layout.py``); where the
bytes live - replicated, sharded or offloaded parameters, full or sharded
gradients - is the run's ``Storage`` (``storage.py``), picked once from the ZeRO
stage by ``storage_for``, so nothing here asks the stage. A tied word embedding
gets a bucket of its own, so the first and last pipeline stage shard it
identically and can sum their shards over the embedding group. A chunk's
mixture-of-experts expert weights (``ParamSpec.expert``) fill a buffer of their
own (``expert``), sharded over the expert-data-parallel group. Under ZeRO 3
``unit_of`` closes buckets at unit boundaries, so a unit gathers whole buckets.
The buffer's storage makes its parameter-shard store (``--offload-params``) and
the buffer closes it (``close``).
"""
from __future__ import annotations

import torch
from torch import nn

from .layout import Bucket, plan_buckets
from .param_offload import DiskParamShards, Fetch, HostParamShards
from .storage import Storage


class ParamGradBuffer:
    """Flat storage for one chunk's parameters and main gradients (see the module docstring); what differs
    by ZeRO stage is in ``param_storage`` and ``grad_storage``, built from the run's ``storage``."""

    def __init__(self, params: list[nn.Parameter], *, bucket_size: int, num_shards: int, shard_rank: int,
                 param_dtype: torch.dtype, grad_dtype: torch.dtype, storage: Storage, device: torch.device,
                 unit_of: dict[nn.Parameter, int] | None = None, expert: bool = False) -> None:
        self.params = list(reversed(params))  # backward order
        self.expert = expert  # holds expert weights: reduced and sharded over the expert-data-parallel group
        self.num_shards, self.grad_dtype, self.param_dtype = num_shards, grad_dtype, param_dtype
        self.buckets, self.offsets = plan_buckets(self.params, bucket_size, num_shards, shard_rank, unit_of)
        self.numel = sum(b.numel for b in self.buckets)
        self.device = device
        self.param_storage = storage.params(self.buckets, self.offsets, num_shards, param_dtype, device)
        self.grad_storage = storage.grads(self.buckets, self.offsets, num_shards, grad_dtype, device)

    @property
    def param_data(self) -> torch.Tensor | None:
        """Every parameter, flat (replicated storage; None when sharded)."""
        return self.param_storage.data

    @property
    def param_shard_data(self) -> torch.Tensor | None:
        """The persistent parameter shards (ZeRO 3 on the device; else None)."""
        return self.param_storage.shard_data

    @property
    def param_store(self) -> HostParamShards | DiskParamShards | None:
        """ZeRO 3 + --offload-params: where the shards live (made by the storage, closed by ``close``); else None."""
        return self.param_storage.store

    @property
    def fetch_deferred(self) -> bool:
        """A shard fetch completes later (the disk tier): ZeRO 3's all-gathers wait for the prefetch to issue them."""
        return self.param_storage.deferred

    @property
    def grad_data(self) -> torch.Tensor | None:
        """The full main-grad buffer (ZeRO 0/1; else None)."""
        return self.grad_storage.data

    @property
    def grad_shard_data(self) -> torch.Tensor | None:
        """The persistent grad shards (ZeRO 2/3; else None)."""
        return self.grad_storage.shard_data

    def materialize_params(self, b: Bucket) -> torch.Tensor:
        """ZeRO 3: give bucket ``b``'s full-size parameter storage its bytes back (contents undefined)."""
        return self.param_storage.materialize(b)

    def free_params(self, b: Bucket) -> None:
        """ZeRO 3: drop the full-size parameters of ``b``; the params keep their shapes but have no bytes."""
        self.param_storage.free(b)

    def bucket_grad(self, b: Bucket) -> torch.Tensor:
        """The full-size gradient [numel] of bucket ``b``; allocated (zeros) on demand under ZeRO 2/3."""
        return self.grad_storage.bucket(b)

    def release(self, b: Bucket) -> None:
        """ZeRO 2/3: drop the full-size bucket gradient once its shard has been reduced out of it."""
        self.grad_storage.release(b)

    def grad_shard(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced-gradient shard [shard_numel] of bucket ``b``."""
        return self.grad_storage.shard(b)

    def param_shard(self, b: Bucket) -> torch.Tensor:
        """This rank's parameter shard [shard_numel] of bucket ``b`` (what the optimizer step updates)."""
        return self.param_storage.shard(b)

    def read_param_shard(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s parameter shard wherever it lives (offloaded to disk: a copy read back)."""
        return self.param_storage.read(b)

    def fetch_param_shard(self, b: Bucket) -> Fetch:
        """Start bringing ``b``'s shard to the device (ZeRO 3's gather); ``.result()`` is the tensor."""
        return self.param_storage.fetch(b)

    def set_param_shard(self, b: Bucket, values: torch.Tensor, lo: int = 0) -> None:
        """Store updated shard elements [lo, lo + n) ``values`` (cast to the parameter dtype) where ``b``'s
        shard lives (the disk-offloaded optimizer may update a shard in pieces)."""
        self.param_storage.write(b, values, lo)

    def flush_param_shards(self) -> None:
        """--offload-params disk: wait for the write-behind of updated shards (errors surface here)."""
        self.param_storage.flush()

    def param_bucket(self, b: Bucket) -> torch.Tensor:
        """The full-size parameters [numel] of bucket ``b`` (ZeRO 3: materialized first)."""
        return self.param_storage.bucket(b)

    def zero_grad(self) -> None:
        """Start a step: accumulation restarts from zero and no bucket has communicated."""
        self.grad_storage.zero()
        for b in self.buckets:
            b.ready, b.launched = 0, False
            self.release(b)

    def close(self) -> None:
        """Release the parameter-shard store this buffer's storage made (the disk tier removes its file)."""
        self.param_storage.close()
