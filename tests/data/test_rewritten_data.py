"""Data rewritten under the same name: caches keyed on content, token files published as a pair.

- the sample-index cache beside the data is keyed on the document lengths, so re-preprocessing
  a prefix with the same documents in another order (same count, same total) builds new
  windows instead of reusing the old ones (an IndexError, or other windows, before);
- a crash between publishing the new ``.bin`` and the new ``.idx`` never leaves the old
  ``.idx`` beside the new ``.bin`` (same size, so it would load and cut the wrong documents);
- the default corpus is keyed on the files it is built from, so a changed standard library
  gets a fresh corpus.
"""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import megazero.data.corpus as corpus_module
import megazero.data.indexed as indexed_module
from megazero.data import build_data, default_corpus
from megazero.data.gpt_dataset import GPTDataset
from megazero.data.indexed import IndexedDataset
from megazero.data.preprocess import preprocess_files, write_documents
from megazero.data.tokenizer import Tokenizer, train_sentencepiece

SEQ, SAMPLES, SEED = 16, 120, 7


def _words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(n)]


def _docs(n: int) -> list[str]:
    rng = random.Random(0)
    words = _words(200, 0)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 60))) for _ in range(n)]


def _train(prefix: str, tok: str) -> torch.utils.data.Dataset:
    bundle = build_data(data_path=[prefix], tokenizer_model=tok, split="100,0,0", seq_length=SEQ,
                        train_samples=SAMPLES, eval_samples=0, seed=SEED, is_builder=True, log=lambda s: None)
    return bundle.train


def test_repreprocessed_prefix_gets_the_windows_of_the_new_files(tmp_path) -> None:
    docs = _docs(60)
    tok = train_sentencepiece(_docs(400), str(tmp_path / "tok"), vocab_size=300)
    prefix = str(tmp_path / "data" / "corpus")
    (tmp_path / "a.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "b.txt").write_text("\n".join(reversed(docs)) + "\n")  # same documents, another order
    preprocess_files([str(tmp_path / "a.txt")], prefix, tok, log=lambda s: None)
    first = _train(prefix, tok)
    old = [first[i] for i in range(SAMPLES)]
    assert len(os.listdir(tmp_path / "data" / "index-cache")) == 3  # the cache the second build could reuse
    old_index = IndexedDataset(prefix)
    preprocess_files([str(tmp_path / "b.txt")], prefix, tok, log=lambda s: None)
    new_index = IndexedDataset(prefix)
    assert (len(new_index), new_index.num_tokens) == (len(old_index), old_index.num_tokens)
    assert not np.array_equal(new_index.doc_lengths, old_index.doc_lengths)
    second = _train(prefix, tok)
    fresh = GPTDataset(new_index, SEQ, SAMPLES, SEED, np.arange(len(new_index)), cache_dir=str(tmp_path / "fresh"))
    got = [second[i] for i in range(SAMPLES)]
    assert all(torch.equal(g, f) for g, f in zip(got, (fresh[i] for i in range(SAMPLES))))
    assert any(not torch.equal(g, o) for g, o in zip(got, old))  # the data did change under the name


def test_a_crash_between_bin_and_idx_never_pairs_the_old_idx_with_the_new_bin(tmp_path, monkeypatch) -> None:
    prefix = str(tmp_path / "d")
    docs = [list(range(d * 10, d * 10 + 1 + d % 7)) for d in range(30)]
    write_documents(docs, prefix, vocab_size=1000, log=lambda s: None)
    real = os.replace

    def crash_on_idx(src, dst, *args, **kwargs):
        if str(dst).endswith(".idx"):
            raise OSError("simulated crash")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(indexed_module.os, "replace", crash_on_idx)
    with pytest.raises(OSError, match="simulated"):
        write_documents(list(reversed(docs)), prefix, vocab_size=1000, log=lambda s: None)
    monkeypatch.undo()
    try:
        ds = IndexedDataset(prefix)
    except ValueError as err:  # no .idx: a clear error naming the file
        assert "d.idx" in str(err)
    else:
        assert [ds[i].tolist() for i in range(len(ds))] == list(reversed(docs))
    assert sorted(os.listdir(tmp_path)) in (["d.bin"], ["d.bin", "d.idx"])  # no temporaries left


def _fake_stdlib(root: str, words: list[str]) -> None:
    os.makedirs(root, exist_ok=True)
    rng = random.Random(1)
    for f in range(3):
        funcs = [f'def f{i}():\n    """{" ".join(rng.choice(words) for _ in range(rng.randint(6, 30)))}."""\n'
                 for i in range(150)]
        with open(os.path.join(root, f"mod{f}.py"), "w") as fh:
            fh.write("\n".join(funcs))


def test_default_corpus_is_rebuilt_when_its_sources_change(tmp_path, monkeypatch) -> None:
    stdlib = str(tmp_path / "stdlib")
    _fake_stdlib(stdlib, _words(300, 2))
    monkeypatch.setattr(corpus_module.sysconfig, "get_paths", lambda: {"stdlib": stdlib})
    cache = str(tmp_path / "cache")
    first = default_corpus(vocab_size=300, cache_dir=cache, log=lambda s: None)
    marker = "Rewritten docstring: the standard library changed under the cache."
    with open(os.path.join(stdlib, "mod1.py"), "a") as fh:
        fh.write(f'\n\nclass Changed:\n    """{marker}"""\n')
    second = default_corpus(vocab_size=300, cache_dir=cache, log=lambda s: None)
    tok = Tokenizer.load(second.tokenizer_model)
    ds = IndexedDataset(second.data_prefix)
    texts = [tok.decode(ds[i][:-1]) for i in range(len(ds))]
    assert marker in texts and len(ds) == len(IndexedDataset(first.data_prefix)) + 1
