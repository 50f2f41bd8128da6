"""Data for training: tokenizer, token files, GPT windows, blending, DP slicing.

The trainer calls ``build_data`` once per process and wraps ``bundle.train``
in a ``MicroBatchIterator``. Every rank calls it with the same arguments;
only the builder (global rank 0) writes caches, before each ``barrier()``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .blend import BlendedDataset, blend_counts, parse_data_path
from .corpus import CorpusPaths, default_corpus
from .gpt_dataset import GPTDataset, epochs_needed, split_documents
from .indexed import IndexedDataset
from .sampler import MicroBatchIterator, to_device
from .tokenizer import Tokenizer, TokenizerLike, load_tokenizer
from .tokenizer_check import check_data_tokenizer, check_default_corpus

__all__ = [
    "BlendedDataset", "CorpusPaths", "DataBundle", "GPTDataset", "IndexedDataset", "MicroBatchIterator",
    "SplitShare", "Tokenizer", "TokenizerLike", "build_data", "check_data_tokenizer", "check_vocabulary",
    "default_corpus", "load_tokenizer", "parse_data_path", "to_device",
]


@dataclass(frozen=True)
class SplitShare:
    """What one split reads of one dataset: the numbers a run's start-up summary shows."""

    prefix: str
    split: str  # training, validation or test
    weight: float  # the dataset's normalised blend weight (1.0 alone)
    dataset_documents: int  # the whole dataset, every split
    dataset_tokens: int
    documents: int  # this split's
    tokens: int
    samples: int  # windows of seq_length + 1 tokens this run reads
    epochs: int  # passes over this split's documents those samples take


@dataclass
class DataBundle:
    """The tokenizer and the three splits (None when a split gets no data), and what each dataset gives."""

    tokenizer: TokenizerLike
    train: torch.utils.data.Dataset  # items: int64 tensor [seq_length + 1]
    valid: torch.utils.data.Dataset | None
    test: torch.utils.data.Dataset | None
    shares: list[SplitShare] = field(default_factory=list)


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


def check_vocabulary(sources: list[tuple[float, IndexedDataset]], vocab_size: int | None, tokenizer_model: str,
                     tokenizer_vocab: int) -> None:
    """Refuse data the model cannot embed: an id past the vocabulary is an IndexError at tp 1
    and, at tp > 1, a zero embedding and a zero target logit that train on garbage.

    ``vocab_size`` is the model's (--vocab-size or the checkpoint's; None: the tokenizer's). Every
    rank reads the headers itself (a version-1 file is scanned once), so all fail alike.
    """
    model_vocab = vocab_size or tokenizer_vocab
    origin = (f"--tokenizer-model {tokenizer_model} has {tokenizer_vocab} tokens" if vocab_size is None else
              f"from --vocab-size or the checkpoint; --tokenizer-model {tokenizer_model} has {tokenizer_vocab}")
    for _, indexed in sources:
        data_vocab = indexed.vocab_size
        if (data_vocab is not None and data_vocab > model_vocab) or indexed.max_token_id >= model_vocab:
            made = f"a {data_vocab}-piece vocabulary" if data_vocab is not None else "an unrecorded vocabulary"
            raise ValueError(
                f"data {indexed.prefix}.idx was tokenized with {made} (largest id {indexed.max_token_id}) but the "
                f"model vocabulary is {model_vocab} ({origin}); pass the --tokenizer-model (and --vocab-size) the "
                f"data was made with, or re-run tools/preprocess_data.py with {tokenizer_model}"
            )


_SPLIT_NAMES = ("training", "validation", "test")
_SPLIT_FLAGS = ("--train-iters x --global-batch-size", "--eval-iters x --global-batch-size", "--eval-iters")


def _share(indexed: IndexedDataset, weight: float, docs: np.ndarray, split_index: int, seq_length: int,
           num_samples: int) -> SplitShare:
    """The numbers of one split of one dataset (the start-up summary prints them; a repeat is warned of)."""
    tokens = int(indexed.doc_lengths[docs].sum())
    return SplitShare(prefix=indexed.prefix, split=_SPLIT_NAMES[split_index], weight=weight,
                      dataset_documents=len(indexed), dataset_tokens=int(indexed.doc_lengths.sum()),
                      documents=len(docs), tokens=tokens, samples=num_samples,
                      epochs=epochs_needed(tokens, seq_length, num_samples))


def _warn_repeats(share: SplitShare, split_index: int, seq_length: int, log: Callable[[str], None]) -> None:
    """Say so when a split is read more than once (a small corpus silently repeats otherwise)."""
    if share.epochs > 1:
        log(f"warning: the {share.split} split of {share.prefix} holds {share.tokens} tokens "
            f"({max(1, share.tokens // seq_length)} samples of {seq_length + 1}); {share.samples} samples "
            f"({_SPLIT_FLAGS[split_index]}) read it {share.epochs} epochs; add data or train for fewer samples")


def _build_split(sources: list[tuple[float, IndexedDataset]], split_index: int, split: str,
                 seq_length: int, num_samples: int, seed: int, is_builder: bool,
                 barrier: Callable[[], None], log: Callable[[str], None], cache_dir: str | None,
                 shares: list[SplitShare]) -> torch.utils.data.Dataset | None:
    """One split (0 train, 1 valid, 2 test) over all sources, blended by weight; appends what each gives
    to ``shares``."""
    if num_samples <= 0:
        return None
    parts = []
    for weight, indexed in sources:
        docs = split_documents(len(indexed), split)[split_index]
        if len(docs) and int(indexed.doc_lengths[docs].sum()) >= 2:
            parts.append((weight, indexed, docs))
    if not parts:
        return None
    weights = [w for w, _, _ in parts]
    counts = [num_samples] if len(parts) == 1 else blend_counts(weights, num_samples, seed)
    datasets = []
    for (weight, indexed, docs), count in zip(parts, counts):
        count = max(count, 1)
        shares.append(_share(indexed, weight, docs, split_index, seq_length, count))
        if split_index < 2:  # the test split is not read by training
            _warn_repeats(shares[-1], split_index, seq_length, log)
        datasets.append(GPTDataset(indexed, seq_length, count, seed, docs, cache_dir=cache_dir,
                                   is_builder=is_builder, barrier=barrier))
    return datasets[0] if len(datasets) == 1 else BlendedDataset(datasets, weights, num_samples, seed)


def _tokenizer(tokenizer_model: str | None, tokenizer_type: str | None, default_model: str | None) -> TokenizerLike:
    """The run's tokenizer: --tokenizer-model (of --tokenizer-type, or inferred), else the default corpus's."""
    if tokenizer_model is None and default_model is None:
        raise ValueError("--data-path needs --tokenizer-model (the sentencepiece .model or HF tokenizer.json the "
                         "data was tokenized with)")
    if tokenizer_model is None and tokenizer_type == "hf":
        raise ValueError("--tokenizer-type hf needs --tokenizer-model (the default corpus's tokenizer is a "
                         "sentencepiece model); pass the tokenizer.json or drop --tokenizer-type")
    return load_tokenizer(tokenizer_model or default_model, tokenizer_type)


def build_data(*, data_path: list[str] | None, tokenizer_model: str | None, split: str,
               seq_length: int, train_samples: int, eval_samples: int, seed: int,
               is_builder: bool, barrier: Callable[[], None] = lambda: None,
               log: Callable[[str], None] = print, vocab_size: int | None = None,
               tokenizer_type: str | None = None, data_cache_path: str | None = None) -> DataBundle:
    """Tokenizer plus train/valid/test datasets for the given flags.

    With ``data_path=None`` the embedded stdlib-docstring corpus is used (built
    by the builder before the first barrier, loaded by the others after it).
    ``vocab_size`` is the model's vocabulary (None: the tokenizer's); data with
    larger ids is refused. ``eval_samples > 0`` means evaluation was asked for,
    so a split with no validation data is an error rather than a silent no-op.
    ``data_cache_path`` holds the sample-index caches (None: beside each prefix).
    """
    default_model = None
    if data_path is None:
        corpus = default_corpus(log=log) if is_builder else None
        barrier()
        corpus = corpus or default_corpus(log=log)
        data_path, default_model = [corpus.data_prefix], corpus.tokenizer_model
    tokenizer = _tokenizer(tokenizer_model, tokenizer_type, default_model)
    if default_model is not None and tokenizer_model is not None:  # run() checked --data-path before the groups;
        check_default_corpus(data_path[0], tokenizer, tokenizer_model, log=lambda _: None)  # the corpus: built now
    sources = _open_sources(list(data_path))
    check_vocabulary(sources, vocab_size, tokenizer_model or default_model, tokenizer.vocab_size)
    shares: list[SplitShare] = []
    build = dict(seq_length=seq_length, seed=seed, is_builder=is_builder, barrier=barrier, log=log,
                 cache_dir=data_cache_path, shares=shares)
    train = _build_split(sources, 0, split, num_samples=train_samples, **build)
    if train is None:
        raise ValueError(f"--split {split!r} leaves no training documents; give the first split a larger weight")
    valid = _build_split(sources, 1, split, num_samples=eval_samples, **build)
    if eval_samples > 0 and valid is None:
        raise ValueError(f"--eval-interval asks for validation but --split {split!r} leaves no validation data "
                         f"in {', '.join(ix.prefix for _, ix in sources)}; give the second --split weight a share "
                         "(e.g. 969,30,1), add documents, or set --eval-interval 0")
    test = _build_split(sources, 2, split, num_samples=eval_samples, **build)
    return DataBundle(tokenizer=tokenizer, train=train, valid=valid, test=test, shares=shares)
