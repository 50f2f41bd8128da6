"""Measure what autograd keeps for backward, to check the planner's activation figures against reality.

``SavedTensorMeter`` is a ``torch.autograd.graph.saved_tensors_hooks`` context
that records every tensor saved during a forward, deduplicated by storage
(views of one buffer cost its bytes once, as they do in memory) and with the
parameters' own storages excluded (those are model state, not activations).
Tensors saved inside a non-reentrant checkpoint region are never seen (the
checkpoint's inner hooks replace them), but the region's inputs are, because
checkpoint saves them through an autograd Function before entering it: so
the meter counts exactly what recomputation keeps.
"""
from __future__ import annotations

from typing import Iterable

import torch


class SavedTensorMeter:
    """``with SavedTensorMeter(model.parameters()) as meter: loss = model(x)``; then ``meter.bytes``."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, tuple[int, torch.dtype]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes > 0 and ptr not in self.excluded:
            self.storages[ptr] = (max(nbytes, self.storages.get(ptr, (0, t.dtype))[0]), t.dtype)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(n for n, _ in self.storages.values())
