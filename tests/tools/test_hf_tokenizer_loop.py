"""One byte-level BPE tokenizer.json through the whole loop (issue 31): preprocessing, training at tp 2 x pp 2,
--skip-train, generation and the HF export all use it, and the exported folder's tokenizer encodes hard
strings (code, tabs, CRLF, accents, emoji, CJK, right-to-left) exactly as the training tokenizer does.

One 4-rank launch trains and saves; --skip-train runs in one process (another layout of the same
checkpoint), so its validation loss equals the training run's to fp32 reduction-order rounding, not bitwise
(tests/checkpoint/test_finetune.py checks the bitwise case in the saving layout).
"""
from __future__ import annotations

import json

import pytest

from megazero.data.tokenizer import load_tokenizer
from megazero.data.corpus import corpus_documents
from megazero.data.preprocess import preprocess_files
from tests.helpers.hf_tokenizers import HARD_STRINGS, byte_level_tokenizer
from tests.helpers.launch import launch
from tests.helpers.tool_module import load_tool

transformers = pytest.importorskip("transformers")

VOCAB = 300
PROMPT = "def main(args):\n\treturn"
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--log-interval", "1",
         "--eval-interval", "2", "--eval-iters", "1", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_loop")
    tok_json = byte_level_tokenizer(str(tmp / "tok"), VOCAB)
    with open(tmp / "docs.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": doc}) + "\n" for doc in corpus_documents(max_bytes=60_000))
    preprocess_files([str(tmp / "docs.jsonl")], str(tmp / "data"), str(tmp / "tok"), workers=1, log=lambda *_: None)
    data = ["--data-path", str(tmp / "data"), "--tokenizer-model", tok_json]
    results = launch("pretrain_gpt.py", [*SMALL, *data, "--tp", "2", "--pp", "2", "--save", str(tmp / "ck"),
                                         "--metrics-file", str(tmp / "train.jsonl")], 4)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank}:\n{r.stderr[-3000:]}"
    [evaluated] = launch("pretrain_gpt.py", [*SMALL, *data, "--load", str(tmp / "ck"), "--skip-train",
                                             "--metrics-file", str(tmp / "eval.jsonl")], 1)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert load_tool("convert_checkpoint").main(["--input", str(tmp / "ck"), "--output", str(tmp / "hf"),
                                                 "--to", "hf"]) == 0
    return tmp, tok_json


def _val_losses(path) -> list[float]:
    with open(path, encoding="utf-8") as fh:
        return [r["val_loss"] for r in map(json.loads, fh) if r.get("event") == "eval"]


def test_skip_train_reports_the_run_s_validation_loss(loop):
    tmp, _ = loop
    [trained], [evaluated] = _val_losses(tmp / "train.jsonl"), _val_losses(tmp / "eval.jsonl")
    assert abs(evaluated - trained) <= 1e-5 * abs(trained), (evaluated, trained)


def test_generation_and_export_tokenize_as_training(loop, capsys):
    tmp, tok_json = loop
    ours = load_tokenizer(tok_json)
    capsys.readouterr()
    assert load_tool("generate").main(["--load", str(tmp / "ck"), "--prompt", PROMPT, "--max-new-tokens", "8",
                                       "--print-ids"]) == 0
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert record["prompt_ids"] == ours.encode(PROMPT)  # the checkpoint names the run's tokenizer
    exported = transformers.AutoTokenizer.from_pretrained(tmp / "hf")
    for text in [PROMPT, *HARD_STRINGS]:
        assert exported(text, add_special_tokens=False)["input_ids"] == ours.encode(text), repr(text)
        assert ours.decode(ours.encode(text)) == text, repr(text)
    assert exported.eos_token_id == ours.eos_id
