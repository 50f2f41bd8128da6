"""Preprocessing parquet and save_to_disk inputs (byte-identical to JSONL), and --data-cache-path (issue 31)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from megazero.data.gpt_dataset import GPTDataset
from megazero.data.preprocess import preprocess_files
from megazero.data.tokenizer import train_sentencepiece
from tests.helpers.indexed_data import make_indexed
from tests.helpers.text_docs import make_docs

QUIET = dict(log=lambda *_: None)
UNICODE = ["café\tnaïve 😀", "def f():\n    return 1", "Straße 中文"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Documents, a tokenizer, and the JSONL reference files (.bin/.idx bytes) made from them."""
    tmp = tmp_path_factory.mktemp("formats")
    docs = make_docs(300, seed=4) + UNICODE
    tok = train_sentencepiece(docs, str(tmp / "tok"), vocab_size=600)
    with open(tmp / "docs.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"body": doc, "id": len(doc)}) + "\n")
    preprocess_files([str(tmp / "docs.jsonl")], str(tmp / "ref" / "d"), tok, json_key="body", **QUIET)
    ref = {ext: open(tmp / "ref" / f"d{ext}", "rb").read() for ext in (".bin", ".idx")}
    return SimpleNamespace(tmp=tmp, docs=docs, tok=tok, ref=ref)


def _same_bytes(prefix: str, ref: dict[str, bytes]) -> bool:
    return all(open(prefix + ext, "rb").read() == data for ext, data in ref.items())


def test_parquet_matches_jsonl_bytes(texts: SimpleNamespace, tmp_path) -> None:
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "parquet"
    folder.mkdir()
    cut = len(texts.docs) // 3
    for i, part in enumerate((texts.docs[:cut], texts.docs[cut:])):  # two shards, read in name order
        pq.write_table(pa.table({"id": list(range(len(part))), "body": part}), folder / f"part-{i:05d}.parquet")
    inputs = {"one file": [str(folder / "part-00000.parquet"), str(folder / "part-00001.parquet")],
              "folder": [str(folder)], "glob": [str(folder / "part-*.parquet")]}
    for name, given in inputs.items():
        prefix = str(tmp_path / name.replace(" ", "_") / "d")
        preprocess_files(given, prefix, texts.tok, json_key="body", workers=2 if name == "folder" else 1, **QUIET)
        assert _same_bytes(prefix, texts.ref), name
    with pytest.raises(ValueError, match="--json-keys"):
        preprocess_files([str(folder)], str(tmp_path / "x" / "d"), texts.tok, json_key="text", **QUIET)


def test_save_to_disk_matches_jsonl_bytes(texts: SimpleNamespace, tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": texts.docs}).save_to_disk(str(saved))
    before = sorted(os.listdir(saved))
    preprocess_files([str(saved)], str(tmp_path / "a" / "d"), texts.tok, json_key="body", workers=2, **QUIET)
    assert _same_bytes(str(tmp_path / "a" / "d"), texts.ref)
    assert sorted(os.listdir(saved)) == before  # no cache files written into the user's dataset
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": texts.docs}),
                                   "test": datasets.Dataset.from_dict({"body": ["held out"]})})
    splits.save_to_disk(str(tmp_path / "dict"))
    preprocess_files([str(tmp_path / "dict")], str(tmp_path / "b" / "d"), texts.tok, json_key="body", **QUIET)
    assert _same_bytes(str(tmp_path / "b" / "d"), texts.ref)  # the train split


def test_input_errors_name_what_was_found(texts: SimpleNamespace, tmp_path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.md").write_text("x")
    (tmp_path / "bad.parquet").write_text("not parquet")
    cases = [
        ([str(tmp_path / "plain")], ["holds no .parquet files", "save_to_disk", "notes.md"]),
        ([str(tmp_path / "nothing-*.parquet")], ["does not exist", "--input"]),
        ([str(tmp_path / "bad.parquet")], ["could not read", "parquet"]),
        ([str(tmp_path / "bad.parquet"), str(texts.tmp / "docs.jsonl")], ["mixes json and parquet"]),
    ]
    for given, words in cases:
        with pytest.raises(ValueError) as err:
            preprocess_files(given, str(tmp_path / "o" / "d"), texts.tok, json_key="body", **QUIET)
        assert all(w in str(err.value) for w in words), str(err.value)


def test_data_cache_path_holds_the_caches(tmp_path) -> None:
    """Two datasets of one name share a --data-cache-path folder without mixing their indices; their samples
    equal those of the default cache location beside the data."""
    a = make_indexed(str(tmp_path / "a"), n_docs=40, seed=1)
    b = make_indexed(str(tmp_path / "b"), n_docs=60, seed=2)  # same basename "data", other documents
    cache = str(tmp_path / "cache")
    for indexed in (a, b):
        shared = GPTDataset(indexed, 8, 30, seed=3, cache_dir=cache)
        beside = GPTDataset(indexed, 8, 30, seed=3)
        assert all(np.array_equal(shared[i].numpy(), beside[i].numpy()) for i in range(30))
    assert len([n for n in os.listdir(cache) if n.endswith("_shuffle_idx.npy")]) == 2
