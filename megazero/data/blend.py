"""Blending several datasets by weight, and the ``--data-path`` syntax.

Sample i of the blend goes to the source that is most "behind" its share.
We compute that with stride scheduling: source k's c-th sample is due at
time ``(c + phase_k) / w_k`` and the blend serves samples in order of due
time. After any n samples every source's count is within one (plus ties) of
``w_k * n``, the same guarantee as Megatron's greedy rule, but computed with
one stable sort instead of a per-sample loop.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch


def parse_data_path(args: Sequence[str]) -> list[tuple[float, str]]:
    """``[PREFIX]`` or ``[W1, PREFIX1, W2, PREFIX2, ...]`` -> normalised (weight, prefix)."""
    args = list(args)
    if not args:
        raise ValueError("--data-path is empty; give PREFIX or 'W1 PREFIX1 W2 PREFIX2 ...'")
    if len(args) == 1:
        return [(1.0, args[0])]
    if len(args) % 2:
        raise ValueError(f"--data-path with several datasets needs weight/prefix pairs, got {len(args)} items: {args}")
    pairs = []
    for w, prefix in zip(args[0::2], args[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"--data-path weight {w!r} (before {prefix!r}) is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"--data-path weight {w!r} for {prefix!r} must be a positive number")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def blend_assignment(weights: Sequence[float], num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(source of each blended sample, its index within that source)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w <= 0):
        raise ValueError(f"blend weights must be positive, got {list(weights)}")
    w = w / w.sum()
    phase = np.random.RandomState(seed % 2**32).uniform(0.25, 0.75, size=len(w))
    due, source = [], []
    for k, wk in enumerate(w):
        # enough candidates that the first num_samples by due time never depend on num_samples:
        # the n-th due time is below n + 0.75 * len(w), and source k has fewer than wk * that before it
        count = int(math.ceil(wk * (num_samples + len(w)))) + 1
        due.append((np.arange(count) + phase[k]) / wk)
        source.append(np.full(count, k, dtype=np.int64))
    order = np.argsort(np.concatenate(due), kind="stable")[:num_samples]
    dataset_index = np.concatenate(source)[order]
    sample_index = np.empty(num_samples, dtype=np.int64)
    for k in range(len(w)):
        mask = dataset_index == k
        sample_index[mask] = np.arange(int(mask.sum()))
    return dataset_index, sample_index


def blend_counts(weights: Sequence[float], num_samples: int, seed: int) -> list[int]:
    """Samples each source must provide for a blend of ``num_samples``."""
    dataset_index, _ = blend_assignment(weights, num_samples, seed)
    return np.bincount(dataset_index, minlength=len(weights)).tolist()


class BlendedDataset(torch.utils.data.Dataset):
    """Deterministic weighted mix of ``datasets`` with ``num_samples`` items."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float],
                 num_samples: int, seed: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} blend weights")
        self.datasets = list(datasets)
        self.num_samples = num_samples
        self.dataset_index, self.sample_index = blend_assignment(weights, num_samples, seed)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for k, (ds, need) in enumerate(zip(self.datasets, counts)):
            if len(ds) < need:
                raise ValueError(f"blended source {k} has {len(ds)} samples but the blend needs {need}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]
