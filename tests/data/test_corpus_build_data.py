"""The embedded default corpus and the trainer's entry point ``build_data``."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from megazero.data import DataBundle, build_data, default_corpus
from megazero.data.fingerprint import read_fingerprint
from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter
from megazero.data.tokenizer import Tokenizer

VOCAB = 8000  # the default, so build_data(data_path=None) finds this cache


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("corpus"))
    default_corpus(vocab_size=VOCAB, cache_dir=root, log=lambda s: None)
    return root


def test_corpus_builds_and_is_usable(corpus_root: str) -> None:
    lines: list[str] = []
    stamps = {name: os.stat(os.path.join(dirpath, name)).st_mtime_ns
              for dirpath, _, names in os.walk(corpus_root) for name in names}
    paths = default_corpus(vocab_size=VOCAB, cache_dir=corpus_root, log=lines.append)
    assert lines == []  # cached: silent, and nothing rebuilt or rewritten
    assert stamps == {name: os.stat(os.path.join(dirpath, name)).st_mtime_ns
                      for dirpath, _, names in os.walk(corpus_root) for name in names}
    assert f"-v1-vocab{VOCAB}-" in os.path.basename(os.path.dirname(paths.data_prefix))  # then the sources' hash
    tok = Tokenizer.load(paths.tokenizer_model)
    ds = IndexedDataset(paths.data_prefix)
    assert tok.vocab_size == VOCAB and ds.dtype == np.uint16
    assert len(ds) > 1000 and ds.num_tokens > 200_000
    text = tok.decode(ds[0][:-1])
    assert ds[0][-1] == tok.eos_id and len(text) >= 20
    assert read_fingerprint(paths.data_prefix) == (tok.fingerprint(), paths.tokenizer_model)  # checked as any data
    assert [n for n in os.listdir(corpus_root) if n.startswith(".")] == []  # no temp dir left


def test_corpus_is_deterministic(corpus_root: str, tmp_path) -> None:
    lines: list[str] = []
    other = default_corpus(vocab_size=VOCAB, cache_dir=str(tmp_path), log=lines.append)
    assert any("stdlib docstrings" in s for s in lines) and any("training tokenizer" in s for s in lines)
    first = default_corpus(vocab_size=VOCAB, cache_dir=corpus_root, log=lambda s: None)
    for a, b in ((first.tokenizer_model, other.tokenizer_model),
                 (first.data_prefix + ".bin", other.data_prefix + ".bin"),
                 (first.data_prefix + ".idx", other.data_prefix + ".idx")):
        assert digest(a) == digest(b)


def test_build_data_default_corpus(corpus_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGAZERO_CACHE", corpus_root)
    barriers: list[int] = []
    bundle = build_data(data_path=None, tokenizer_model=None, split="98,2,0", seq_length=32,
                        train_samples=64, eval_samples=8, seed=1, is_builder=True,
                        barrier=lambda: barriers.append(1), log=lambda s: None)
    assert isinstance(bundle, DataBundle) and bundle.test is None
    assert bundle.tokenizer.vocab_size == VOCAB
    assert len(bundle.train) == 64 and len(bundle.valid) == 8
    assert bundle.train[0].shape == (33,) and bundle.train[0].dtype == torch.int64
    assert len(barriers) == 3  # corpus, train indices, valid indices
    follower = build_data(data_path=None, tokenizer_model=None, split="98,2,0", seq_length=32,
                          train_samples=64, eval_samples=8, seed=1, is_builder=False, log=lambda s: None)
    assert torch.equal(follower.train[5], bundle.train[5])


def _prefix(folder: str, name: str, base: int, n_docs: int = 40) -> str:
    prefix = os.path.join(folder, name)
    with IndexedDatasetWriter(prefix, vocab_size=VOCAB) as w:
        for d in range(n_docs):
            w.add_document(np.full(20, base + d % 5))
    return prefix


def test_build_data_blend_and_errors(corpus_root: str, tmp_path) -> None:
    tok = default_corpus(vocab_size=VOCAB, cache_dir=corpus_root).tokenizer_model
    a = _prefix(str(tmp_path), "a", base=100)
    b = _prefix(str(tmp_path), "b", base=500)
    kw = dict(split="90,10,0", seq_length=10, train_samples=1000, eval_samples=20, seed=0,
              is_builder=True, log=lambda s: None)
    bundle = build_data(data_path=["0.8", a, "0.2", b], tokenizer_model=tok, **kw)
    first = np.array([int(bundle.train[i][0]) for i in range(1000)])
    assert abs((first >= 500).mean() - 0.2) < 0.02
    assert bundle.valid is not None and len(bundle.valid) == 20
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_data(data_path=[a], tokenizer_model=None, **kw)
    with pytest.raises(ValueError, match="--data-path") as err:
        build_data(data_path=[str(tmp_path / "nope")], tokenizer_model=tok, **kw)
    assert "nope" in str(err.value)
    with pytest.raises(ValueError, match="--split"):
        build_data(data_path=[a], tokenizer_model=tok, **{**kw, "split": "0,1,0"})
