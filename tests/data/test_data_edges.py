"""Data at the edges (issue #13): the vocabulary in the .idx header, an order that does not
depend on the run length, resuming with another global batch, and too little data said aloud."""

from __future__ import annotations

import json
import os
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megazero.data import build_data
from megazero.data.blend import blend_assignment
from megazero.data.corpus import corpus_documents
from megazero.data.gpt_dataset import GPTDataset, build_indices
from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter
from megazero.data.preprocess import tokenize_documents, write_documents
from megazero.data.tokenizer import Tokenizer, train_sentencepiece
from tests.helpers.indexed_data import make_indexed
from tests.helpers.launch import launch

MODEL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--log-interval", "1", "--lr", "1e-3"]
QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Two tokenizers (2,000 and 400 pieces) of the same text, and the text tokenized by each."""
    tmp = tmp_path_factory.mktemp("edges")
    docs = [d for d in corpus_documents(max_bytes=200_000) if d.isascii()]
    out = SimpleNamespace(tmp=tmp)
    for name, vocab in (("big", 2000), ("small", 400)):
        model = train_sentencepiece(docs, str(tmp / name), vocab)
        write_documents(tokenize_documents(docs, Tokenizer.load(model)), str(tmp / f"{name}_data"), vocab, **QUIET)
        setattr(out, name, SimpleNamespace(model=model, data=str(tmp / f"{name}_data")))
    return out


def _one_line_errors(results, nproc: int) -> list[str]:
    assert len(results) == nproc
    lines = []
    for rank, r in enumerate(results):
        assert r.returncode == 2, f"rank {rank}: exit {r.returncode}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        errs = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(errs) == 1, f"rank {rank}: expected one error line, got:\n{r.stderr[-3000:]}"
        lines.append(errs[0])
    return lines


# ---- vocabulary in the .idx header -------------------------------------------------------------

def test_idx_header_records_vocab_and_largest_id(tmp_path) -> None:
    prefix = str(tmp_path / "d")
    with IndexedDatasetWriter(prefix, vocab_size=1000) as w:
        w.add_document([5, 7, 2])
        w.add_document([999, 2])
    ds = IndexedDataset(prefix)
    assert (ds.version, ds.vocab_size, ds.max_token_id) == (2, 1000, 999)
    assert ds[1].tolist() == [999, 2]
    with IndexedDatasetWriter(prefix + "_empty", vocab_size=70_000) as w:
        w.add_document([])
    empty = IndexedDataset(prefix + "_empty")
    assert (empty.vocab_size, empty.max_token_id, len(empty)) == (70_000, -1, 1)


def _write_v1(prefix: str, docs: list[list[int]]) -> None:
    """The version-1 format by hand: magic, version, dtype, n_docs, offsets (no vocabulary)."""
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype("<i8")
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<8sIIQ", b"MZIDX\x00\x00\x00", 1, 1, len(docs)))
        f.write(offsets.tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate([np.asarray(d, dtype="<u2") for d in docs]).tobytes())


def test_v1_idx_still_reads_and_is_scanned_for_its_largest_id(tmp_path, corpus) -> None:
    prefix = str(tmp_path / "old")
    docs = [[3, 4, 5, 2], [1500, 2], [7, 8, 9, 10, 2]]
    _write_v1(prefix, docs)
    ds = IndexedDataset(prefix)
    assert (ds.version, ds.vocab_size, len(ds)) == (1, None, 3)
    assert [ds[i].tolist() for i in range(3)] == docs
    assert ds.max_token_id == 1500 == int(np.fromfile(prefix + ".bin", dtype="<u2").max())
    kw = dict(split="100,0,0", seq_length=4, train_samples=4, eval_samples=0, seed=0, is_builder=True, **QUIET)
    with pytest.raises(ValueError, match="1500") as err:  # the 400-piece model cannot embed id 1500
        build_data(data_path=[prefix], tokenizer_model=corpus.small.model, **kw)
    assert "old.idx" in str(err.value) and "small.model" in str(err.value)
    assert len(build_data(data_path=[prefix], tokenizer_model=corpus.big.model, **kw).train) == 4


@pytest.mark.parametrize("nproc,flags", [(1, []), (2, ["--tp", "2"])], ids=["tp1", "tp2"])
def test_data_tokenized_with_a_larger_vocabulary_fails_on_every_rank(corpus, nproc: int, flags: list[str]) -> None:
    """2,000-piece data, 400-piece --tokenizer-model: tp1 used to die with IndexError, tp2 trained on garbage."""
    args = [*MODEL, *flags, "--global-batch-size", "4", "--train-iters", "2",
            "--data-path", corpus.big.data, "--tokenizer-model", corpus.small.model]
    for line in _one_line_errors(launch("pretrain_gpt.py", args, nproc, timeout=300), nproc):
        assert "big_data.idx" in line and "small.model" in line and "2000" in line and "400" in line, line


# ---- an order that does not depend on the run length ------------------------------------------

def test_gpt_order_is_a_prefix_across_epoch_boundaries(tmp_path) -> None:
    """Every shorter run reads a prefix of a 4-epoch run, whatever epoch it ends in."""
    indexed = make_indexed(str(tmp_path))
    docs = np.arange(len(indexed), dtype=np.int64)
    lengths = indexed.doc_lengths
    seq = 7
    tokens = int(lengths.sum())
    longest = (4 * tokens - 1) // seq
    ref = build_indices(lengths, docs, seq, longest, seed=3)
    for n in range(1, longest):
        got = build_indices(lengths, docs, seq, n, seed=3)
        assert np.array_equal(got["shuffle_idx"], ref["shuffle_idx"][:n]), n
        rows = got["shuffle_idx"]  # the windows those indices name are the same windows
        assert np.array_equal(got["sample_idx"][rows], ref["sample_idx"][rows]), n
    two_epochs = (2 * tokens - 1) // seq  # the most samples two epochs hold: ends in a partial block
    short = GPTDataset(indexed, seq, two_epochs, seed=3)
    long = GPTDataset(indexed, seq, longest, seed=3)
    for i in range(two_epochs):
        assert torch.equal(short[i], long[i]), i


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.2, 0.3, 0.5], [0.05, 0.15, 0.3, 0.5], [0.7, 0.1, 0.1, 0.1],
                                     [0.01, 0.99]])
def test_blend_order_is_a_prefix(weights: list[float]) -> None:
    for seed in range(4):
        ref_source, ref_index = blend_assignment(weights, 600, seed)
        for n in range(1, 300):
            source, index = blend_assignment(weights, n, seed)
            assert np.array_equal(source, ref_source[:n]) and np.array_equal(index, ref_index[:n]), (seed, n)


def test_blended_build_data_is_a_prefix_across_epochs(corpus, tmp_path) -> None:
    """Two sources blended through build_data: a run of 500 samples (several epochs) starts with each shorter run."""
    a = make_indexed(str(tmp_path), n_docs=30, seed=1, name="a").prefix
    b = make_indexed(str(tmp_path), n_docs=20, seed=2, name="b").prefix
    kw = dict(data_path=["0.6", a, "0.4", b], tokenizer_model=corpus.big.model, split="100,0,0", seq_length=9,
              eval_samples=0, seed=11, is_builder=True, vocab_size=100_000, **QUIET)
    long = build_data(train_samples=500, **kw).train
    for n in (150, 185, 278, 356):  # 185, 278, 356 ended in a partial shuffle block of a source before the fix
        short = build_data(train_samples=n, **kw).train
        for i in range(n):
            assert torch.equal(short[i], long[i]), (n, i)


# ---- resuming with another --global-batch-size, through pretrain_gpt.py ------------------------

def _run(corpus, tmp, name: str, nproc: int, flags: list[str]) -> list[dict]:
    metrics = os.path.join(tmp, f"{name}.jsonl")
    args = [*MODEL, "--data-path", corpus.small.data, "--tokenizer-model", corpus.small.model,
            *flags, "--metrics-file", metrics]
    for rank, r in enumerate(launch("pretrain_gpt.py", args, nproc, timeout=300)):
        assert r.returncode == 0, f"{name} rank {rank} failed:\n{r.stderr[-3000:]}"
    return [r for r in map(json.loads, open(metrics)) if "event" not in r]


def _loss_on(folder: str, indices: range, corpus) -> float:
    """Mean loss of the saved model on dataset samples ``indices`` (one process, no torch.distributed)."""
    from megazero.checkpoint import load as ckpt_load
    from megazero.checkpoint import storage
    from megazero.config import Config
    from megazero.parallel.state import ParallelState
    from megazero.pipeline.partition import build_chunks
    from megazero.run_plan import RunPlan

    folder = storage.resolve(folder)
    meta = storage.read_metadata(folder)
    cfg = Config.from_flat(meta["config"])
    pstate = ParallelState.serial()
    chunks = build_chunks(cfg, RunPlan.resolve(cfg, pstate.layout.world_size), pstate)
    ckpt_load.load_model_weights(folder, meta, chunks, pstate)
    data = build_data(data_path=[corpus.small.data], tokenizer_model=corpus.small.model, split=cfg.data.split,
                      seq_length=cfg.model.seq_length, train_samples=indices.stop, eval_samples=0,
                      seed=cfg.training.seed, is_builder=True, **QUIET)
    tokens = torch.stack([data.train[i] for i in indices])
    with torch.no_grad():
        return float(chunks[0].eval()(tokens[:, :-1], tokens[:, 1:]))


@pytest.mark.parametrize("new_gbs,nproc", [(4, 2), (16, 1)], ids=["smaller-dp2", "larger"])
def test_resume_with_another_global_batch(corpus, tmp_path, new_gbs: int, nproc: int) -> None:
    """Saved at G=8 after 2 steps (16 samples); resumed at G' it trains to the end, reading [16, 16+G') next."""
    ckpt = str(tmp_path / "ckpt")
    first = _run(corpus, str(tmp_path), "first", 1, ["--global-batch-size", "8", "--train-iters", "2", "--save", ckpt])
    assert first[-1]["consumed_samples"] == 16
    resumed = _run(corpus, str(tmp_path), "resumed", nproc,
                   ["--global-batch-size", str(new_gbs), "--train-iters", "5", "--load", ckpt])
    assert [r["iteration"] for r in resumed] == [3, 4, 5]
    assert [r["consumed_samples"] for r in resumed] == [16 + k * new_gbs for k in (1, 2, 3)]
    want = _loss_on(ckpt, range(16, 16 + new_gbs), corpus)
    assert abs(resumed[0]["loss"] - want) <= 1e-5 * abs(want), (resumed[0]["loss"], want)
    other = _loss_on(ckpt, range(0, new_gbs), corpus)  # the check can tell samples apart
    assert abs(other - want) > 1e-4 * abs(want)  # 10x the match tolerance above


# ---- too little data --------------------------------------------------------------------------

def test_eval_without_validation_data_is_an_error(corpus) -> None:
    kw = dict(data_path=[corpus.small.data], tokenizer_model=corpus.small.model, seq_length=32, train_samples=8,
              seed=0, is_builder=True, **QUIET)
    with pytest.raises(ValueError, match="--eval-interval") as err:
        build_data(split="100,0,0", eval_samples=8, **kw)
    assert "--split" in str(err.value)
    assert build_data(split="100,0,0", eval_samples=0, **kw).valid is None  # no eval asked: fine
    assert len(build_data(split="90,10,0", eval_samples=8, **kw).valid) == 8


def test_eval_without_validation_data_fails_through_pretrain(corpus) -> None:
    args = [*MODEL, "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "1", "--split", "100,0,0",
            "--data-path", corpus.small.data, "--tokenizer-model", corpus.small.model]
    line = _one_line_errors(launch("pretrain_gpt.py", args, 1, timeout=300), 1)[0]
    assert "--eval-interval" in line and "--split" in line, line


def test_repeating_a_small_corpus_warns_with_the_epoch_count(tmp_path, corpus) -> None:
    indexed = make_indexed(str(tmp_path), n_docs=10)
    tokens = int(indexed.doc_lengths.sum())
    seq = 8
    samples = 9 * tokens // seq  # about nine passes over the data
    epochs = -(-(samples * seq + 1) // tokens)
    lines: list[str] = []
    build_data(data_path=[indexed.prefix], tokenizer_model=corpus.big.model, split="100,0,0", seq_length=seq,
               train_samples=samples, eval_samples=0, seed=0, is_builder=True, vocab_size=100_000, log=lines.append)
    warnings = [line for line in lines if "warning" in line.lower()]
    assert len(warnings) == 1 and f"{epochs} epochs" in warnings[0], lines
    lines.clear()
    build_data(data_path=[indexed.prefix], tokenizer_model=corpus.big.model, split="100,0,0", seq_length=seq,
               train_samples=tokens // seq - 1, eval_samples=0, seed=0, is_builder=True, vocab_size=100_000,
               log=lines.append)
    assert not [line for line in lines if "warning" in line.lower()], lines
