"""Data for training: tokenizer, token files, GPT windows, blending, DP slicing.

The trainer calls ``build_data`` once per process and wraps ``bundle.train``
in a ``MicroBatchIterator``. Every rank calls it with the same arguments;
only the builder (global rank 0) writes caches, before each ``barrier()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megazero.data.blend import BlendedDataset, blend_counts, parse_data_path
from megazero.data.corpus import CorpusPaths, default_corpus
from megazero.data.gpt_dataset import GPTDataset, split_documents
from megazero.data.indexed import IndexedDataset
from megazero.data.sampler import MicroBatchIterator
from megazero.data.tokenizer import Tokenizer

__all__ = [
    "BlendedDataset", "CorpusPaths", "DataBundle", "GPTDataset", "IndexedDataset",
    "MicroBatchIterator", "Tokenizer", "build_data", "default_corpus", "parse_data_path",
]


@dataclass
class DataBundle:
    """The tokenizer and the three splits (None when a split gets no data)."""

    tokenizer: Tokenizer
    train: torch.utils.data.Dataset  # items: int64 tensor [seq_length + 1]
    valid: torch.utils.data.Dataset | None
    test: torch.utils.data.Dataset | None


def _open_sources(data_path: list[str]) -> list[tuple[float, IndexedDataset]]:
    sources = []
    for weight, prefix in parse_data_path(data_path):
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ValueError(
                f"data prefix {prefix!r} has no {' or '.join(missing)}; --data-path takes the prefix "
                "written by tools/preprocess_data.py (without .bin/.idx)"
            )
        sources.append((weight, IndexedDataset(prefix)))
    return sources


def _build_split(sources: list[tuple[float, IndexedDataset]], split_index: int, split: str,
                 seq_length: int, num_samples: int, seed: int, is_builder: bool,
                 barrier: Callable[[], None]) -> torch.utils.data.Dataset | None:
    """One split (0 train, 1 valid, 2 test) over all sources, blended by weight."""
    if num_samples <= 0:
        return None
    parts = []
    for weight, indexed in sources:
        docs = split_documents(len(indexed), split)[split_index]
        if len(docs) and int(indexed.doc_lengths[docs].sum()) >= 2:
            parts.append((weight, indexed, docs))
    if not parts:
        return None
    if len(parts) == 1:
        _, indexed, docs = parts[0]
        return GPTDataset(indexed, seq_length, num_samples, seed, docs, is_builder=is_builder, barrier=barrier)
    weights = [w for w, _, _ in parts]
    counts = blend_counts(weights, num_samples, seed)
    datasets = [
        GPTDataset(indexed, seq_length, max(count, 1), seed, docs, is_builder=is_builder, barrier=barrier)
        for (_, indexed, docs), count in zip(parts, counts)
    ]
    return BlendedDataset(datasets, weights, num_samples, seed)


def build_data(*, data_path: list[str] | None, tokenizer_model: str | None, split: str,
               seq_length: int, train_samples: int, eval_samples: int, seed: int,
               is_builder: bool, barrier: Callable[[], None] = lambda: None,
               log: Callable[[str], None] = print) -> DataBundle:
    """Tokenizer plus train/valid/test datasets for the given flags.

    With ``data_path=None`` the embedded stdlib-docstring corpus is used (built
    by the builder before the first barrier, loaded by the others after it).
    """
    if data_path is None:
        corpus = default_corpus(log=log) if is_builder else None
        barrier()
        corpus = corpus or default_corpus(log=log)
        data_path = [corpus.data_prefix]
        tokenizer_model = tokenizer_model or corpus.tokenizer_model
    elif tokenizer_model is None:
        raise ValueError("--data-path needs --tokenizer-model (the sentencepiece model the data was tokenized with)")
    tokenizer = Tokenizer.load(tokenizer_model)
    sources = _open_sources(list(data_path))
    train = _build_split(sources, 0, split, seq_length, train_samples, seed, is_builder, barrier)
    if train is None:
        raise ValueError(f"--split {split!r} leaves no training documents; give the first split a larger weight")
    valid = _build_split(sources, 1, split, seq_length, eval_samples, seed, is_builder, barrier)
    test = _build_split(sources, 2, split, seq_length, eval_samples, seed, is_builder, barrier)
    return DataBundle(tokenizer=tokenizer, train=train, valid=valid, test=test)
