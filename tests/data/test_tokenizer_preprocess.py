"""Tokenizer training, preprocessing to .bin/.idx, and their error paths."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter
from megazero.data.preprocess import preprocess_files
from megazero.data.tokenizer import Tokenizer, train_sentencepiece
from tests.helpers.launch import run_python
from tests.helpers.text_docs import make_docs

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tok")
    return train_sentencepiece(make_docs(2000, seed=1), str(folder / "tok"), vocab_size=400)


def test_tokenizer_ids_and_roundtrip(tok_model: str) -> None:
    tok = Tokenizer.load(tok_model)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (400, 1, 2, 3)
    text = "  Hello, Wörld!\n\tnew line ☃ 123"  # unseen chars survive via byte fallback
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(["ab cd", "x"]) == [tok.encode("ab cd"), tok.encode("x")]


def test_training_is_deterministic(tmp_path, tok_model: str) -> None:
    again = train_sentencepiece(make_docs(2000, seed=1), str(tmp_path / "tok"), vocab_size=400)
    with open(again, "rb") as a, open(tok_model, "rb") as b:
        assert a.read() == b.read()


def test_training_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="empty"):
        train_sentencepiece(["", "  \n"], str(tmp_path / "t"), vocab_size=100)
    with pytest.raises(ValueError, match="--vocab-size"):
        train_sentencepiece(["ab"] * 10, str(tmp_path / "t"), vocab_size=5000)


@pytest.mark.parametrize("fmt,workers", [("text", 1), ("json", 2)])
def test_preprocess_roundtrip(tmp_path, tok_model: str, fmt: str, workers: int) -> None:
    docs = make_docs(300, seed=2)
    if fmt == "text":
        path = tmp_path / "in.txt"
        path.write_text("\n".join(docs) + "\n\n")  # blank lines are not documents
    else:
        path = tmp_path / "in.jsonl"
        path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    prefix = str(tmp_path / "out" / "data")
    stats = preprocess_files([str(path)], prefix, tok_model, json_key="body", workers=workers, log=lambda s: None)
    ds = IndexedDataset(prefix)
    tok = Tokenizer.load(tok_model)
    assert len(ds) == len(docs) == stats.documents
    assert ds.num_tokens == stats.tokens
    assert ds.dtype == np.uint16
    for i, doc in enumerate(docs):
        ids = ds[i]
        assert ids[-1] == tok.eos_id
        assert tok.decode(ids[:-1]) == doc
    leftovers = [n for n in os.listdir(tmp_path / "out")
                 if n not in ("data.bin", "data.idx", "data.tokenizer-fingerprint.json")]
    assert leftovers == []  # no HF cache or temp file left behind


def test_writer_uint32_and_get(tmp_path) -> None:
    prefix = str(tmp_path / "big")
    docs = [np.array([70000, 5, 99999]), np.array([], dtype=np.int64), np.array([1, 2])]
    with IndexedDatasetWriter(prefix, vocab_size=100000) as w:
        for d in docs:
            w.add_document(d)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint32 and len(ds) == 3 and ds.num_tokens == 5
    assert ds[0].tolist() == [70000, 5, 99999] and ds[1].tolist() == [] and ds[2].tolist() == [1, 2]
    assert ds.get(0, 1, 2).tolist() == [5, 99999]
    assert os.path.getsize(prefix + ".bin") == 5 * 4
    assert sorted(os.listdir(tmp_path)) == ["big.bin", "big.idx"]


def test_writer_discards_on_error(tmp_path) -> None:
    prefix = str(tmp_path / "x")
    with pytest.raises(ValueError, match="out of range"):
        with IndexedDatasetWriter(prefix, vocab_size=10) as w:
            w.add_document([1, 2])
            w.add_document([11])
    assert os.listdir(tmp_path) == []


def _write_small(prefix: str) -> None:
    with IndexedDatasetWriter(prefix, vocab_size=100) as w:
        w.add_document([1, 2, 3])
        w.add_document([4, 5])


@pytest.mark.parametrize("damage,match", [
    ("magic", "bad magic"),
    ("version", "version"),
    ("truncate_idx", "truncated"),
    ("short_header", "truncated"),
    ("truncate_bin", "expects"),
])
def test_corruption_is_clear_error(tmp_path, damage: str, match: str) -> None:
    prefix = str(tmp_path / "d")
    _write_small(prefix)
    idx = bytearray(open(prefix + ".idx", "rb").read())
    if damage == "magic":
        idx[0:2] = b"XX"
    elif damage == "version":
        idx[8] = 7
    elif damage == "truncate_idx":
        idx = idx[:-4]
    elif damage == "short_header":
        idx = idx[:10]
    if damage == "truncate_bin":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(4)
    else:
        open(prefix + ".idx", "wb").write(bytes(idx))
    with pytest.raises(ValueError, match=match) as err:
        IndexedDataset(prefix)
    assert "d.bin" in str(err.value) or "d.idx" in str(err.value)


def test_preprocess_errors(tmp_path, tok_model: str) -> None:
    quiet = {"log": lambda s: None}
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"text": "hi"}\n{"body": "x"}\n')
    jsonl_nokey = tmp_path / "b.jsonl"
    jsonl_nokey.write_text('{"body": "hi"}\n')
    bad_model = tmp_path / "bad.model"
    bad_model.write_text("not a model")
    out = str(tmp_path / "o" / "d")
    cases = [
        (([str(tmp_path / "nope.txt")], out, tok_model), "--input"),
        (([str(empty)], out, tok_model), "empty"),
        (([str(blank)], out, tok_model), "no documents"),
        (([str(jsonl_nokey)], out, tok_model), "--json-keys"),
        (([str(jsonl)], out, tok_model), "lack key"),
        (([str(blank)], out, str(bad_model)), "--tokenizer-model"),
        (([str(blank)], out, str(tmp_path / "missing.model")), "missing.model"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            preprocess_files(*args, **quiet)


def test_cli_errors_in_process(tmp_path, capsys: pytest.CaptureFixture) -> None:
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import preprocess_data
        import train_tokenizer
    finally:
        sys.path.remove(os.path.join(REPO, "tools"))
    (tmp_path / "e.txt").write_text("")
    (tmp_path / "k.jsonl").write_text('{"body": "x"}\n')
    runs = [
        (train_tokenizer.main, ["--input", str(tmp_path / "nope.txt"), "--model-prefix", "p", "--vocab-size", "50"]),
        (train_tokenizer.main, ["--input", str(tmp_path / "e.txt"), "--model-prefix", "p", "--vocab-size", "50"]),
        (train_tokenizer.main, ["--input", str(tmp_path / "k.jsonl"), "--model-prefix", "p", "--vocab-size", "50"]),
        (preprocess_data.main, ["--input", str(tmp_path / "e.txt"), "--output-prefix", str(tmp_path / "o"),
                                "--tokenizer-model", str(tmp_path / "none.model")]),
    ]
    for main, argv in runs:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("tool", ["train_tokenizer.py", "preprocess_data.py"])
def test_cli_subprocess_no_traceback(tmp_path, tool: str) -> None:
    args = {"train_tokenizer.py": ["--model-prefix", "p", "--vocab-size", "50"],
            "preprocess_data.py": ["--output-prefix", "o", "--tokenizer-model", "t.model"]}[tool]
    proc = run_python([os.path.join(REPO, "tools", tool), "--input", "missing.jsonl", *args], cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr


def test_preprocess_with_hf_tokenizer(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3, "fox": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="<eos>").save_pretrained(
        str(tmp_path / "hf"))
    (tmp_path / "in.txt").write_text("hello world\nfox fox cat\n")
    prefix = str(tmp_path / "out")
    preprocess_files([str(tmp_path / "in.txt")], prefix, str(tmp_path / "hf"), tokenizer_type="hf",
                     log=lambda s: None)
    ds = IndexedDataset(prefix)
    assert [ds[0].tolist(), ds[1].tolist()] == [[2, 3, 1], [4, 4, 0, 1]]
