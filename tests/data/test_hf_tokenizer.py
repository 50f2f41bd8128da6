"""HF tokenizers (issue 31): a byte-level BPE tokenizer.json trained here, used by preprocessing, the data
pipeline and a training run; the type inferred from the path; errors that say what is at the path."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megazero.data import build_data
from megazero.data.corpus import corpus_documents
from megazero.data.hf_tokenizer import END_OF_TEXT, HFTokenizer, train_byte_level_bpe
from megazero.data.indexed import IndexedDataset
from megazero.data.preprocess import preprocess_files
from megazero.data.tokenizer import Tokenizer, load_tokenizer, resolve_tokenizer, train_sentencepiece
from tests.helpers.hf_tokenizers import HARD_STRINGS
from tests.helpers.launch import ROOT

VOCAB = 512
QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A byte-level BPE folder, the JSONL it was trained on, and that JSONL preprocessed with it."""
    tmp = tmp_path_factory.mktemp("hf_tok")
    docs = corpus_documents(max_bytes=100_000)
    with open(tmp / "docs.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    tok_json = train_byte_level_bpe(docs, str(tmp / "tok"), VOCAB)
    preprocess_files([str(tmp / "docs.jsonl")], str(tmp / "data" / "corpus"), str(tmp / "tok"), workers=2, **QUIET)
    return SimpleNamespace(tmp=tmp, docs=docs, folder=str(tmp / "tok"), json=tok_json,
                           prefix=str(tmp / "data" / "corpus"))


def test_byte_level_roundtrip_and_special_ids(hf: SimpleNamespace) -> None:
    tok = load_tokenizer(hf.folder)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == VOCAB
    raw = json.load(open(hf.json))
    eos = next(t["id"] for t in raw["added_tokens"] if t["content"] == END_OF_TEXT)
    assert (tok.eos_id, tok.pad_id) == (eos, eos)  # padding falls back to EOS, as Llama 3 and Qwen do
    for text in HARD_STRINGS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and max(ids) < VOCAB
    assert tok.encode_batch(HARD_STRINGS) == [tok.encode(t) for t in HARD_STRINGS]
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(hf.folder)
    assert theirs.eos_token_id == tok.eos_id
    assert [theirs(t, add_special_tokens=False)["input_ids"] for t in HARD_STRINGS] == tok.encode_batch(HARD_STRINGS)


def test_type_inferred_from_the_path(hf: SimpleNamespace, tmp_path) -> None:
    sp_model = train_sentencepiece(hf.docs[:200], str(tmp_path / "sp"), vocab_size=600)
    shutil.copyfile(sp_model, tmp_path / "tokenizer.model")
    bare = tmp_path / "bare"  # a tokenizer.json without tokenizer_config.json, under another name
    bare.mkdir()
    shutil.copyfile(hf.json, bare / "my_tokenizer")
    assert resolve_tokenizer(hf.folder) == ("hf", hf.json)
    assert resolve_tokenizer(hf.json) == ("hf", hf.json)
    assert resolve_tokenizer(str(bare / "my_tokenizer")) == ("hf", str(bare / "my_tokenizer"))
    assert resolve_tokenizer(sp_model) == ("sentencepiece", sp_model)
    assert resolve_tokenizer(str(tmp_path)) == ("sentencepiece", str(tmp_path / "tokenizer.model"))
    assert resolve_tokenizer(hf.folder, "hf") == ("hf", hf.json)
    assert isinstance(load_tokenizer(sp_model), Tokenizer) and load_tokenizer(sp_model).eos_id == 2
    bare_tok = load_tokenizer(str(bare / "my_tokenizer"))  # EOS found among the usual end-of-text tokens
    assert bare_tok.eos_id == load_tokenizer(hf.folder).eos_id


def test_errors_say_what_is_at_the_path(hf: SimpleNamespace, tmp_path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "vocab.txt").write_text("a\n")
    (tmp_path / "garbage.bin").write_bytes(b"\x00\x01not a tokenizer")
    no_eos = json.load(open(hf.json))
    no_eos["added_tokens"] = []
    no_eos["model"]["vocab"].pop(END_OF_TEXT)
    (tmp_path / "no_eos.json").write_text(json.dumps(no_eos))
    (tmp_path / "bad_cfg").mkdir()
    shutil.copyfile(hf.json, tmp_path / "bad_cfg" / "tokenizer.json")
    (tmp_path / "bad_cfg" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    cases = [
        ((str(tmp_path / "missing"),), ["does not exist", "tokenizer.json"]),
        ((str(tmp_path / "folder"),), ["is a folder without tokenizer.json", "vocab.txt"]),
        ((hf.json, "sentencepiece"), ["not a readable sentencepiece model", "--tokenizer-type hf"]),
        ((str(tmp_path / "garbage.bin"),), ["not a readable sentencepiece model", "17-byte file", "not a tokenizer"]),
        ((str(hf.tmp / "docs.jsonl"),), ["not a readable HF tokenizer.json", '{"text"']),
        ((str(tmp_path / "no_eos.json"),), ["names no EOS token", "tokenizer_config.json"]),
        ((str(tmp_path / "bad_cfg"),), ["eos_token", "<|im_end|>"]),
    ]
    for args, words in cases:
        with pytest.raises(ValueError) as err:
            load_tokenizer(*args)
        line = str(err.value)
        assert "\n" not in line and all(w in line for w in words), line


def test_preprocess_and_dataset_use_the_tokenizers_eos(hf: SimpleNamespace) -> None:
    tok = load_tokenizer(hf.folder)
    indexed = IndexedDataset(hf.prefix)
    assert len(indexed) == len(hf.docs) and indexed.vocab_size == VOCAB
    for i in (0, 1, len(hf.docs) - 1):
        ids = indexed[i].tolist()
        assert ids[-1] == tok.eos_id and tok.decode(ids[:-1]) == hf.docs[i]
    bundle = build_data(data_path=[hf.prefix], tokenizer_model=hf.json, split="98,2,0", seq_length=16,
                        train_samples=8, eval_samples=4, seed=1, is_builder=True, tokenizer_type="hf",
                        data_cache_path=str(hf.tmp / "cache"), **QUIET)
    assert bundle.tokenizer.eos_id == tok.eos_id and len(bundle.train) == 8
    assert os.listdir(hf.tmp / "cache") and not os.path.exists(hf.tmp / "data" / "index-cache")
    with pytest.raises(ValueError, match="--tokenizer-type hf needs --tokenizer-model"):
        build_data(data_path=None, tokenizer_model=None, tokenizer_type="hf", split="98,2,0", seq_length=16,
                   train_samples=8, eval_samples=0, seed=1, is_builder=True, **QUIET)


def _unprivileged(cmd: list[str]) -> list[str]:
    """As root, drop the capability that ignores file modes, so a read-only folder is read-only."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only folder cannot be made read-only for us")
    return ["setpriv", "--bounding-set", "-dac_override", "--inh-caps", "-dac_override", *cmd]


def _pretrain(args: list[str]) -> subprocess.CompletedProcess:
    flags = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
             "--log-interval", "1", "--lr", "1e-3", "--device", "cpu", *args]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run(_unprivileged([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags]), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_pretrain_on_hf_tokenized_read_only_data(hf: SimpleNamespace, tmp_path) -> None:
    """Training on byte-level BPE data in a read-only folder: a one-line error without --data-cache-path,
    a run with it (the vocabulary taken from the tokenizer, caches written only under the flag's folder)."""
    data = tmp_path / "ro_data"
    shutil.copytree(os.path.dirname(hf.prefix), data)
    os.chmod(data, 0o555)
    try:
        common = ["--data-path", str(data / "corpus"), "--tokenizer-model", hf.folder]
        refused = _pretrain(common)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        line = refused.stderr.strip().splitlines()[-1]
        assert "--data-cache-path" in line and "read-only" in line, refused.stderr[-2000:]
        cache, metrics = tmp_path / "cache", tmp_path / "m.jsonl"
        ran = _pretrain([*common, "--data-cache-path", str(cache), "--metrics-file", str(metrics)])
        assert ran.returncode == 0, ran.stderr[-3000:]
    finally:
        os.chmod(data, 0o755)
    assert sorted(os.listdir(data)) == ["corpus.bin", "corpus.idx", "corpus.tokenizer-fingerprint.json"]
    assert any(name.startswith("corpus_") and name.endswith("_shuffle_idx.npy") for name in os.listdir(cache))
    losses = [r["loss"] for r in map(json.loads, open(metrics)) if "loss" in r]
    assert len(losses) == 3 and abs(losses[0] - math.log(VOCAB)) < 1.0  # near uniform over the tokenizer's vocab


def test_caches_already_beside_read_only_data_are_read(hf: SimpleNamespace, tmp_path) -> None:
    data = tmp_path / "ro_data"
    shutil.copytree(os.path.dirname(hf.prefix), data)
    build = (f"from megazero.data import GPTDataset, IndexedDataset; "
             f"print(GPTDataset(IndexedDataset({str(data / 'corpus')!r}), 16, 40, 7)[39].tolist())")
    run = [sys.executable, "-c", build]
    first = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    os.chmod(data / "index-cache", 0o555)
    os.chmod(data, 0o555)
    try:
        again = subprocess.run(_unprivileged(run), cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        os.chmod(data, 0o755)
        os.chmod(data / "index-cache", 0o755)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr[-2000:]


def test_train_tokenizer_tool_byte_bpe(tmp_path, capsys: pytest.CaptureFixture) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import train_tokenizer
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    (tmp_path / "in.txt").write_text("\n".join(HARD_STRINGS * 20))
    argv = ["--input", str(tmp_path / "in.txt"), "--model-prefix", str(tmp_path / "t"), "--model-type", "byte-bpe"]
    assert train_tokenizer.main([*argv, "--vocab-size", "300"]) == 0
    tok = load_tokenizer(str(tmp_path / "t"))
    assert tok.vocab_size == 300 and all(tok.decode(tok.encode(t)) == t for t in HARD_STRINGS)
    assert train_tokenizer.main([*argv, "--vocab-size", "100"]) == 2
    assert "--vocab-size must be at least 257" in capsys.readouterr().err
