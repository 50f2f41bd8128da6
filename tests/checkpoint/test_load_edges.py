"""--load takes the model from the checkpoint, and converted checkpoints train in any layout.

- A llama run saved with non-default --rotary-base/--norm-epsilon resumes without those
  flags bitwise (the settings come from the checkpoint's metadata); an explicit
  contradicting flag is one line naming both values; an explicit value equal to the
  checkpoint's resolved setting (untie True vs the saved None) is accepted.
- An HF GPT-2 made by transformers, converted by tools/convert_checkpoint.py to
  tp2 x pp2 and to the default layout, trains under pretrain_gpt.py --load in its own
  layout and in others; the first loss equals the loss transformers computes for that
  model on the run's first global batch.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.launch import launch, run_python

LLAMA = ["--arch", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--log-interval", "1", "--lr", "1e-3", "--train-iters", "4"]
SAVED_ONLY = ["--rotary-base", "5000", "--norm-epsilon", "1e-6"]


def _run(tmp, name: str, nproc: int, flags: list[str]) -> tuple[list, list[dict]]:
    metrics = os.path.join(tmp, f"{name}.jsonl")
    results = launch("pretrain_gpt.py", [*flags, "--metrics-file", metrics], nproc)
    records = [r for r in map(json.loads, open(metrics)) if "loss" in r] if os.path.exists(metrics) else []
    return results, records


def _ok(results, name: str) -> None:
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"{name} rank {rank} failed:\n{r.stderr[-3000:]}"


def test_load_takes_model_settings_from_the_checkpoint(tmp_path):
    tmp, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    results, straight = _run(tmp, "straight", 1, [*LLAMA, *SAVED_ONLY, "--save", ckpt, "--save-interval", "2"])
    _ok(results, "straight")
    iter2 = os.path.join(ckpt, "iter_0000002")

    results, resumed = _run(tmp, "resumed", 1, [*LLAMA, "--load", iter2])
    _ok(results, "resumed")
    assert "model settings" in results[0].stdout and "5000.0" in results[0].stdout
    assert [(r["iteration"], r["loss"]) for r in resumed] == [(r["iteration"], r["loss"]) for r in straight[2:]]

    results, untied = _run(tmp, "untied", 1, [*LLAMA, "--untie-embeddings-and-output-weights", "--load", iter2])
    _ok(results, "untie given explicitly, equal to the llama default the checkpoint resolved")
    assert [r["loss"] for r in untied] == [r["loss"] for r in straight[2:]]

    results, _ = _run(tmp, "contradicts", 1, [*LLAMA, "--rotary-base", "10000", "--load", iter2])
    assert results[0].returncode == 2
    error = results[0].stderr.strip().splitlines()[-1]
    assert "--rotary-base 10000.0" in error and "5000.0" in error, error


def _merge(saved: dict, given: dict):
    from megazero.checkpoint.load import merge_config
    from megazero.config import Config

    cfg = Config.from_flat(given, explicit=frozenset(given))
    meta = {"config": Config.from_flat(saved).to_flat()}
    return merge_config(meta, cfg)[0]


def test_merge_keeps_llama_context_length():
    """A llama checkpoint resumed at a shorter --seq-length keeps its context length (HF export round trip)."""
    llama = {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 256,
             "max_position_embeddings": 256, "vocab_size": 300}
    assert _merge(llama, {"seq_length": 128}).model.position_table_size == 256
    assert _merge(llama, {"seq_length": 512}).model.position_table_size == 512
    assert _merge({**llama, "max_position_embeddings": None}, {"seq_length": 128}).model.position_table_size == 256


def test_merge_resolves_meaning_and_keeps_run_time_settings():
    gpt2 = {"arch": "gpt2", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
            "vocab_size": 300, "hidden_dropout": 0.0}
    merged = _merge(gpt2, {"seq_length": 16, "hidden_dropout": 0.1, "ffn_hidden_size": 256,
                              "tensor_model_parallel_size": 2})
    assert (merged.model.hidden_size, merged.model.vocab_size, merged.parallel.tp) == (64, 300, 2)
    assert (merged.model.seq_length, merged.model.position_table_size, merged.model.hidden_dropout) == (16, 32, 0.1)
    with pytest.raises(ValueError, match=r"--num-query-groups 2 contradicts the checkpoint's None \(i.e. query_gr"):
        _merge(gpt2, {"num_query_groups": 2})
    with pytest.raises(ValueError, match="--seq-length 64"):
        _merge(gpt2, {"seq_length": 64})  # beyond the checkpoint's learned position table
    llama = {**gpt2, "arch": "llama", "num_query_groups": 4}
    assert _merge(llama, {"seq_length": 64, "num_query_groups": None}).model.seq_length == 64


def _hf_gpt2(path: str, vocab: int):
    transformers = pytest.importorskip("transformers")
    from megazero.checkpoint.hf import hf_config
    from megazero.config import ModelConfig

    cfg = ModelConfig(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64,
                      vocab_size=vocab)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_config(cfg)).eval()
    model.save_pretrained(path)
    return model


def _first_batch_loss(model, seq: int, gbs: int, iters: int) -> float:
    """What transformers' model scores on the run's first global batch (data built as the run builds it)."""
    from megazero.data import build_data
    from megazero.data.sampler import MicroBatchIterator

    data = build_data(data_path=None, tokenizer_model=None, split="969,30,1", seq_length=seq,
                      train_samples=iters * gbs, eval_samples=2 * gbs, seed=1234, is_builder=True,
                      log=lambda *_: None)
    batch = torch.cat(MicroBatchIterator(data.train, gbs, 1, 0, 1).next_step())
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def test_converted_hf_checkpoint_trains_in_any_layout(tmp_path):
    from megazero.data import default_corpus

    vocab = default_corpus(log=lambda *_: None).tokenizer_model
    from megazero.data.tokenizer import Tokenizer

    hf = _hf_gpt2(str(tmp_path / "hf"), Tokenizer.load(vocab).vocab_size)
    want = _first_batch_loss(hf, seq=32, gbs=4, iters=2)
    flags = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
             "--log-interval", "1"]
    for name, convert_flags, runs in [
        ("tp2pp2", ["--tp", "2", "--pp", "2"], [(4, ["--tp", "2", "--pp", "2"]), (1, [])]),
        ("default", [], [(1, []), (2, ["--tp", "2"])]),
    ]:
        out = run_python(["tools/convert_checkpoint.py", "--input", str(tmp_path / "hf"), "--output",
                          str(tmp_path / name), "--to", "megazero", *convert_flags])
        assert out.returncode == 0, out.stderr
        for nproc, layout in runs:
            run_name = f"{name}-on-{nproc}-{'-'.join(layout)}"
            results, records = _run(str(tmp_path), run_name, nproc,
                                    [*flags, *layout, "--load", str(tmp_path / name)])
            _ok(results, run_name)
            assert records[0]["iteration"] == 1 and len(records) == 2
            assert abs(records[0]["loss"] - want) <= 1e-5 * want, (run_name, records[0]["loss"], want)
