"""GPT training samples: windows of ``seq_length + 1`` tokens over a shuffled
stream of documents (Megatron's scheme).

Three index arrays define the samples:

- ``doc_idx``: the documents of every epoch, each epoch shuffled;
- ``sample_idx[j] = (position in doc_idx, token offset)`` where window j
  starts; window j covers stream tokens ``[j*L, j*L + L]`` (one token of
  overlap with the next, for the shifted labels), crossing documents freely;
- ``shuffle_idx``: the order in which windows are served.

They are built once by the builder rank and cached beside the data (or in
``--data-cache-path``) as ``.npy`` files named by a hash of everything they
depend on - the document lengths themselves (a digest of the ``.idx``
offsets), not the prefix and counts, so data re-preprocessed under the same
name gets new indices, and two datasets sharing one cache folder share a file
only when their indices are equal; the other ranks wait at ``barrier()`` and
then memory-map them.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import numpy as np
import torch

from .indexed import IndexedDataset

_INDEX_VERSION = 3  # 3: whole shuffle blocks, so the order never depends on num_samples
_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised train/valid/test fractions."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split must be comma-separated numbers like '969,30,1', got {split!r}") from None
    if len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split needs up to 3 non-negative weights with a positive sum, got {split!r}")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_documents(num_docs: int, split: str) -> list[np.ndarray]:
    """Contiguous train/valid/test document ranges (Megatron's rounding)."""
    fractions = parse_split(split)
    bounds = [0]
    for frac in fractions:
        bounds.append(bounds[-1] + int(round(frac * num_docs)))
    diff = bounds[-1] - num_docs  # rounding may overshoot or undershoot by a few
    bounds[1:] = [b - diff for b in bounds[1:]]
    bounds = [min(max(b, 0), num_docs) for b in bounds]
    return [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(3)]


def build_sample_index(doc_lengths: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """``[num_samples + 1, 2]`` (doc_idx position, offset) where each window starts."""
    ends = np.cumsum(doc_lengths[doc_idx], dtype=np.int64)
    starts_of_docs = np.concatenate([[0], ends[:-1]])
    sample_starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # the last document starting at or before each window start; it cannot be
    # empty, since an empty document shares its start with the next one
    pos = np.searchsorted(starts_of_docs, sample_starts, side="right") - 1
    return np.stack([pos, sample_starts - starts_of_docs[pos]], axis=1)


def epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Passes over the documents that ``num_samples`` windows read (each window needs one extra token)."""
    return -(-(num_samples * seq_length + 1) // tokens_per_epoch)


def build_indices(doc_lengths: np.ndarray, doc_indices: np.ndarray, seq_length: int, num_samples: int,
                  seed: int) -> dict[str, np.ndarray]:
    """Compute doc_idx / sample_idx / shuffle_idx; the first ``num_samples`` of one endless order.

    Windows are shuffled in blocks of about one epoch's windows, each block by a
    full permutation drawn in turn from one seeded stream, and only whole blocks
    are ever built. So no block depends on ``num_samples``: a shorter run reads a
    prefix of a longer run's samples, across epoch boundaries too, and a run
    resumed with another --train-iters or --global-batch-size continues the order.
    """
    tokens_per_epoch = int(doc_lengths[doc_indices].sum())
    if tokens_per_epoch < 2:
        raise ValueError("the selected documents hold fewer than 2 tokens; add data or change --split")
    per_block = max(1, tokens_per_epoch // seq_length)
    num_windows = -(-num_samples // per_block) * per_block  # whole shuffle blocks
    num_epochs = epochs_needed(tokens_per_epoch, seq_length, num_windows)
    rng = np.random.RandomState(seed % 2**32)
    epochs = []
    for _ in range(num_epochs):
        epoch = np.array(doc_indices, dtype=np.int64)
        rng.shuffle(epoch)
        epochs.append(epoch)
    doc_idx = np.concatenate(epochs)
    sample_idx = build_sample_index(doc_lengths, doc_idx, seq_length, num_windows)
    shuffle_rng = np.random.RandomState((seed + 1) % 2**32)
    blocks = [start + shuffle_rng.permutation(per_block) for start in range(0, num_windows, per_block)]
    shuffle_idx = np.concatenate(blocks).astype(np.int64)[:num_samples]
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def _cache_key(indexed: IndexedDataset, doc_indices: np.ndarray, seq_length: int, num_samples: int, seed: int) -> str:
    """Hash of everything the indices depend on, so stale caches are never reused.

    The indices are a function of the document lengths, so the key holds their digest: a
    prefix re-preprocessed with the same documents in another order (same count, same total)
    must not reuse windows cut for the old lengths.
    """
    desc = {
        "version": _INDEX_VERSION,
        "prefix": os.path.basename(indexed.prefix),
        "num_docs": len(indexed),
        "num_tokens": indexed.num_tokens,
        "offsets": indexed.offsets_digest,
        "docs": hashlib.sha1(np.ascontiguousarray(doc_indices, dtype=np.int64).tobytes()).hexdigest(),
        "seq_length": seq_length,
        "num_samples": num_samples,
        "seed": seed,
    }
    return hashlib.sha1(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def _check_writable(cache_dir: str) -> None:
    """Refuse, on every rank before the barrier, a cache folder the builder could not write."""
    existing = os.path.abspath(cache_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write the sample index cache {cache_dir} ({existing} is read-only); pass "
                         "--data-cache-path with a writable folder")


def load_or_build_indices(indexed: IndexedDataset, doc_indices: np.ndarray, seq_length: int, num_samples: int,
                          seed: int, cache_dir: str, is_builder: bool,
                          barrier: Callable[[], None]) -> dict[str, np.ndarray]:
    """Builder computes and saves (atomically); everyone then memory-maps.

    Caches already there are only read, so a read-only folder whose caches were built once still works.
    """
    key = _cache_key(indexed, doc_indices, seq_length, num_samples, seed)
    base = os.path.join(cache_dir, f"{os.path.basename(indexed.prefix)}_{key}")
    paths = {name: f"{base}_{name}.npy" for name in _NAMES}
    complete = all(os.path.exists(p) for p in paths.values())
    if not complete:
        _check_writable(cache_dir)
    if is_builder and not complete:
        arrays = build_indices(indexed.doc_lengths, doc_indices, seq_length, num_samples, seed)
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for name, path in paths.items():
                tmp = f"{path}.tmp{os.getpid()}.npy"
                np.save(tmp, arrays[name])
                os.replace(tmp, path)
        except OSError as exc:
            raise ValueError(f"cannot write the sample index cache in {cache_dir} ({exc}); "
                             "pass --data-cache-path with a writable folder") from None
    barrier()
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        raise RuntimeError(f"index cache {missing[0]} is missing after the barrier; "
                           f"is {cache_dir} shared by all ranks?")
    return {name: np.load(path, mmap_mode="r") for name, path in paths.items()}


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` int64 tensors of ``seq_length + 1`` tokens, seeded order."""

    def __init__(self, indexed: IndexedDataset, seq_length: int, num_samples: int, seed: int,
                 doc_indices: np.ndarray | None = None, *, cache_dir: str | None = None, is_builder: bool = True,
                 barrier: Callable[[], None] = lambda: None) -> None:
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
        if num_samples < 1:
            raise ValueError(f"number of samples must be >= 1, got {num_samples}")
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples = num_samples
        docs = (np.arange(len(indexed), dtype=np.int64) if doc_indices is None
                else np.asarray(doc_indices, dtype=np.int64))
        if cache_dir is None:  # --data-cache-path unset
            cache_dir = os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)), "index-cache")
        idx = load_or_build_indices(indexed, docs, seq_length, num_samples, seed, cache_dir, is_builder, barrier)
        self.doc_idx, self.sample_idx, self.shuffle_idx = idx["doc_idx"], idx["sample_idx"], idx["shuffle_idx"]

    def __len__(self) -> int:
        return self.num_samples

    def window(self, j: int) -> np.ndarray:
        """Unshuffled window j of the token stream (``seq_length + 1`` tokens)."""
        pos, offset = (int(v) for v in self.sample_idx[j])
        remaining = self.seq_length + 1
        chunks = []
        while remaining > 0:
            doc = int(self.doc_idx[pos])
            take = min(int(self.indexed.get(doc).shape[0]) - offset, remaining)
            chunks.append(self.indexed.get(doc, offset, take))
            remaining -= take
            pos, offset = pos + 1, 0
        return np.concatenate(chunks)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples}")
        return torch.from_numpy(self.window(int(self.shuffle_idx[i])).astype(np.int64))
