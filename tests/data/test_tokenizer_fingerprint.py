"""Token files record the tokenizer that made them (PREFIX.tokenizer-fingerprint.json), and training refuses a
--tokenizer-model, or a blend partner, that disagrees: on every rank, before any process group."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import sentencepiece as spm

from megazero.data.corpus import default_corpus, existing_corpus
from megazero.data.fingerprint import FINGERPRINT_SUFFIX, read_fingerprint
from megazero.data.preprocess import preprocess_files, write_token_files
from megazero.data.tokenizer import load_tokenizer, train_sentencepiece
from megazero.data.tokenizer_check import check_fingerprints
from tests.helpers.hf_tokenizers import byte_level_tokenizer
from tests.helpers.launch import launch, run_python
from tests.helpers.text_docs import make_docs

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
VOCAB = 400  # both sentencepiece models, and the byte-level BPE: one size, so the vocabulary check passes
MODEL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
         "--log-interval", "1", "--lr", "1e-3", "--device", "cpu"]


def _sha256_of_pieces(pieces: list[str | None]) -> str:
    return hashlib.sha256(json.dumps(pieces, ensure_ascii=False).encode("utf-8")).hexdigest()


def _preprocess_cli(text_file: str, prefix: str, tokenizer: str) -> None:
    proc = run_python([os.path.join(REPO, "tools", "preprocess_data.py"), "--input", text_file, "--output-prefix",
                       prefix, "--tokenizer-model", tokenizer], env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Two sentencepiece models of one vocabulary size trained on two corpora, and each corpus preprocessed by
    tools/preprocess_data.py with its own; an old-style copy of the first (no fingerprint)."""
    tmp = tmp_path_factory.mktemp("fp")
    ns = SimpleNamespace(tmp=tmp)
    for name, seed in (("a", 1), ("b", 2)):
        docs = make_docs(300, seed=seed)
        setattr(ns, f"tok_{name}", train_sentencepiece(docs, str(tmp / f"tok_{name}"), vocab_size=VOCAB))
        (tmp / f"{name}.txt").write_text("\n".join(docs) + "\n")
        setattr(ns, name, str(tmp / "data" / name))
    _preprocess_cli(str(tmp / "a.txt"), ns.a, ns.tok_a)
    preprocess_files([str(tmp / "b.txt")], ns.b, ns.tok_b, log=lambda s: None)
    ns.old = str(tmp / "data" / "old")
    for ext in (".bin", ".idx"):
        shutil.copyfile(ns.a + ext, ns.old + ext)
    return ns


def test_fingerprint_file_holds_what_sentencepiece_says(made: SimpleNamespace) -> None:
    with open(made.a + FINGERPRINT_SUFFIX, encoding="utf-8") as f:
        record = json.load(f)
    sp = spm.SentencePieceProcessor(model_file=made.tok_a)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert record == {"format": 1, "kind": "sentencepiece", "vocab_size": sp.get_piece_size(), "bos_id": sp.bos_id(),
                      "eos_id": sp.eos_id(), "pad_id": sp.pad_id(), "unk_id": sp.unk_id(),
                      "vocab_sha256": _sha256_of_pieces(pieces), "tokenizer_model": os.path.abspath(made.tok_a)}
    other = spm.SentencePieceProcessor(model_file=made.tok_b)
    assert other.get_piece_size() == VOCAB and other.eos_id() == sp.eos_id()  # what the vocabulary check lets by
    with open(made.b + FINGERPRINT_SUFFIX, encoding="utf-8") as f:
        assert json.load(f)["vocab_sha256"] == _sha256_of_pieces(
            [other.id_to_piece(i) for i in range(VOCAB)]) != record["vocab_sha256"]


def test_fingerprint_file_holds_what_tokenizers_says(made: SimpleNamespace) -> None:
    """An HF tokenizer.json of the same size: its fingerprint as the tokenizers library reads the file, and a
    refusal naming the fields that differ from the sentencepiece data (the end-of-document id among them)."""
    from tokenizers import Tokenizer as RawTokenizer

    tok_json = byte_level_tokenizer(str(made.tmp / "hf"), vocab_size=VOCAB)
    prefix = str(made.tmp / "hfdata" / "c")
    preprocess_files([str(made.tmp / "a.txt")], prefix, str(made.tmp / "hf"), log=lambda s: None)
    with open(prefix + FINGERPRINT_SUFFIX, encoding="utf-8") as f:
        record = json.load(f)
    raw = RawTokenizer.from_file(tok_json)
    size = raw.get_vocab_size(with_added_tokens=True)
    eos = raw.token_to_id("<|endoftext|>")
    assert {k: v for k, v in record.items() if k not in ("format", "tokenizer_model")} == {
        "kind": "hf", "vocab_size": size, "bos_id": None, "eos_id": eos, "pad_id": eos, "unk_id": None,
        "vocab_sha256": _sha256_of_pieces([raw.id_to_token(i) for i in range(size)])}
    with pytest.raises(ValueError) as err:
        check_fingerprints([made.a], load_tokenizer(tok_json), tok_json, log=print)
    line = str(err.value)
    assert "\n" not in line and f"data {made.a} was tokenized with another tokenizer than --tokenizer-model" in line
    assert f"eos id 2 vs {eos}" in line and "kind sentencepiece vs hf" in line and made.tok_a in line


def _last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_pretrain_refuses_data_of_another_tokenizer_on_every_rank(made: SimpleNamespace) -> None:
    results = launch("pretrain_gpt.py", [*MODEL, "--data-path", made.a, "--tokenizer-model", made.tok_b], 2)
    for rank, r in enumerate(results):
        assert r.returncode == 2 and "Traceback" not in r.stderr, (rank, r.stderr[-3000:])
        line = _last_line(r)
        assert line.startswith(f"pretrain_gpt.py: error: data {made.a} was tokenized with another tokenizer than "
                               f"--tokenizer-model {made.tok_b} (data vs tokenizer: vocabulary hash"), line
        assert f"re-run tools/preprocess_data.py with --tokenizer-model {made.tok_b}" in line
        assert f"(--tokenizer-model {os.path.abspath(made.tok_a)})" in line
        assert "building process groups" not in r.stdout  # refused before any group


def test_pretrain_refuses_a_blend_of_two_tokenizers(made: SimpleNamespace) -> None:
    results = launch("pretrain_gpt.py", [*MODEL, "--data-path", "0.5", made.a, "0.5", made.b,
                                         "--tokenizer-model", made.tok_a], 2)
    for rank, r in enumerate(results):
        assert r.returncode == 2, (rank, r.stderr[-3000:])
        line = _last_line(r)
        assert f"--data-path files {made.a} and {made.b} were tokenized with different tokenizers" in line, line
        assert f"re-run tools/preprocess_data.py for {made.b} with --tokenizer-model {made.tok_a}" in line


def test_matching_files_train_and_old_files_say_once_they_are_unchecked(made: SimpleNamespace) -> None:
    results = launch("pretrain_gpt.py", [*MODEL, "--data-path", "0.5", made.a, "0.5", made.old,
                                         "--tokenizer-model", made.tok_a], 2)
    for rank, r in enumerate(results):
        assert r.returncode == 0, (rank, r.stderr[-3000:])
    said = [line for line in results[0].stdout.splitlines() if "no tokenizer fingerprint" in line]
    assert said == [f"megazero: data {made.old} has no tokenizer fingerprint (PREFIX{FINGERPRINT_SUFFIX}, written by "
                    "tools/preprocess_data.py since megazero records one), so it cannot be checked against "
                    f"--tokenizer-model {made.tok_a}; re-run tools/preprocess_data.py to have it checked"]
    assert "no tokenizer fingerprint" not in results[1].stdout + results[1].stderr
    assert not os.path.exists(made.old + FINGERPRINT_SUFFIX)  # the user's files are not written


def _old_corpus_cache(root: str) -> str:
    """A copy of the default corpus as an earlier version cached it (no fingerprint); returns its data prefix."""
    built = default_corpus(log=lambda s: None)
    folder = os.path.join(root, os.path.basename(os.path.dirname(built.data_prefix)))
    os.makedirs(folder)
    for name in ("data.bin", "data.idx", "tokenizer.model"):
        shutil.copyfile(os.path.join(os.path.dirname(built.data_prefix), name), os.path.join(folder, name))
    return os.path.join(folder, "data")


def test_old_corpus_cache_gets_its_fingerprint_and_another_tokenizer_is_refused(made: SimpleNamespace) -> None:
    root = str(made.tmp / "cache")
    prefix = _old_corpus_cache(root)
    results = launch("pretrain_gpt.py", [*MODEL, "--tokenizer-model", made.tok_a], 1, env={"MEGAZERO_CACHE": root})
    assert results[0].returncode == 2, results[0].stderr[-3000:]
    line = _last_line(results[0])
    assert f"data {prefix} was tokenized with another tokenizer than --tokenizer-model {made.tok_a}" in line, line
    assert "vocabulary size 8000 vs 400" in line and "drop --tokenizer-model (the built-in corpus" in line
    with open(prefix + FINGERPRINT_SUFFIX, encoding="utf-8") as f:  # written at start-up, from its own tokenizer
        record = json.load(f)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(os.path.dirname(prefix), "tokenizer.model"))
    assert (record["vocab_size"], record["eos_id"], record["vocab_sha256"]) == (
        sp.get_piece_size(), sp.eos_id(), _sha256_of_pieces([sp.id_to_piece(i) for i in range(sp.get_piece_size())]))
    assert existing_corpus(cache_dir=root).data_prefix == prefix


def test_writing_again_replaces_the_fingerprint_and_a_failed_write_leaves_none(made: SimpleNamespace) -> None:
    """A prefix preprocessed again with another tokenizer records that one; a write that fails midway leaves no
    fingerprint naming the old tokenizer beside whatever token files are there."""
    prefix = str(made.tmp / "again" / "d")
    tok_a, tok_b = load_tokenizer(made.tok_a), load_tokenizer(made.tok_b)
    write_token_files([[5, tok_a.eos_id]], prefix, tok_a, made.tok_a, log=lambda s: None)
    write_token_files([[6, tok_b.eos_id]], prefix, tok_b, made.tok_b, log=lambda s: None)
    assert read_fingerprint(prefix) == (tok_b.fingerprint(), os.path.abspath(made.tok_b))

    def failing():
        yield [7, tok_a.eos_id]
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_token_files(failing(), prefix, tok_a, made.tok_a, log=lambda s: None)
    assert read_fingerprint(prefix) is None
