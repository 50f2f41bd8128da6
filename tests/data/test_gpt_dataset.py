"""GPT windows over the document stream, their cached indices, and splits."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megazero.data.gpt_dataset import GPTDataset, load_or_build_indices, split_documents
from tests.helpers.indexed_data import make_indexed


def stream_of(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.indexed[int(d)] for d in ds.doc_idx])


def test_samples_are_stream_windows(tmp_path) -> None:
    indexed = make_indexed(str(tmp_path))
    L = 16
    ds = GPTDataset(indexed, seq_length=L, num_samples=200, seed=3)
    stream = stream_of(ds)
    assert len(stream) >= 200 * L + 1
    crossing = 0
    for i in range(len(ds)):
        item = ds[i]
        assert item.dtype == torch.int64 and item.shape == (L + 1,)
        j = int(ds.shuffle_idx[i])
        assert item.tolist() == stream[j * L:j * L + L + 1].tolist()
        crossing += len(set((item // 100).tolist())) > 1
    assert crossing > 50  # windows do span document boundaries
    order = ds.shuffle_idx.tolist()
    assert len(set(order)) == 200 and max(order) < len(ds.sample_idx) - 1  # distinct windows of the epochs


def test_epochs_cover_each_document_once(tmp_path) -> None:
    indexed = make_indexed(str(tmp_path), n_docs=30)
    docs = np.arange(5, 25)
    ds = GPTDataset(indexed, seq_length=8, num_samples=300, seed=1, doc_indices=docs)
    n = len(docs)
    assert len(ds.doc_idx) % n == 0 and len(ds.doc_idx) // n >= 2
    for e in range(len(ds.doc_idx) // n):
        assert sorted(ds.doc_idx[e * n:(e + 1) * n].tolist()) == docs.tolist()
    assert ds.doc_idx[:n].tolist() != ds.doc_idx[n:2 * n].tolist()  # reshuffled per epoch


def test_deterministic_and_cached(tmp_path) -> None:
    indexed = make_indexed(str(tmp_path))
    a = GPTDataset(indexed, 8, 100, seed=5, cache_dir=str(tmp_path / "c1"))
    b = GPTDataset(indexed, 8, 100, seed=5, cache_dir=str(tmp_path / "c2"))
    c = GPTDataset(indexed, 8, 100, seed=6, cache_dir=str(tmp_path / "c1"))
    assert all(torch.equal(a[i], b[i]) for i in range(100))
    assert any(not torch.equal(a[i], c[i]) for i in range(100))
    assert len(os.listdir(tmp_path / "c1")) == 6 and len(os.listdir(tmp_path / "c2")) == 3
    assert isinstance(GPTDataset(indexed, 8, 100, seed=5, cache_dir=str(tmp_path / "c1")).shuffle_idx, np.memmap)


def test_non_builder_waits_for_builder(tmp_path) -> None:
    indexed = make_indexed(str(tmp_path))
    docs = np.arange(len(indexed))
    cache = str(tmp_path / "cache")
    calls = []

    def barrier() -> None:  # stands in for the builder rank reaching the barrier
        calls.append(1)
        load_or_build_indices(indexed, docs, 8, 50, 0, cache, True, lambda: None)

    follower = GPTDataset(indexed, 8, 50, 0, docs, cache_dir=cache, is_builder=False, barrier=barrier)
    leader = GPTDataset(indexed, 8, 50, 0, docs, cache_dir=cache)
    assert calls == [1]
    assert all(torch.equal(follower[i], leader[i]) for i in range(50))
    with pytest.raises(RuntimeError, match="missing after the barrier"):
        GPTDataset(indexed, 8, 50, 1, docs, cache_dir=cache, is_builder=False)


def test_split_documents() -> None:
    train, valid, test = split_documents(1000, "969,30,1")
    assert (len(train), len(valid), len(test)) == (969, 30, 1)
    assert np.concatenate([train, valid, test]).tolist() == list(range(1000))
    assert [len(s) for s in split_documents(10, "1")] == [10, 0, 0]
    assert sum(len(s) for s in split_documents(7, "1,1,1")) == 7
    for bad in ("a,b", "1,2,3,4", "0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            split_documents(10, bad)


def test_bad_arguments(tmp_path) -> None:
    indexed = make_indexed(str(tmp_path), n_docs=6)
    with pytest.raises(ValueError, match="--seq-length"):
        GPTDataset(indexed, 0, 10, 0)
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        GPTDataset(indexed, 4, 10, 0, doc_indices=np.array([5]))  # doc 5 is empty


def test_shorter_run_reads_a_prefix_of_a_longer_one(tmp_path) -> None:
    """The order depends on the epoch count only: resuming with another --train-iters continues it."""
    indexed = make_indexed(str(tmp_path))
    short = GPTDataset(indexed, seq_length=8, num_samples=20, seed=5)
    longer = GPTDataset(indexed, seq_length=8, num_samples=60, seed=5)  # same single epoch
    assert len(short) == 20 and len(longer) == 60
    for i in range(20):
        assert torch.equal(short[i], longer[i]), i
