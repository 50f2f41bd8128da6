"""--load takes the data and the tokenizer from the checkpoint, as it takes the model; a preset's model yields.

The user's own data: an HF byte-level BPE tokenizer (tools/train_tokenizer.py) and token files
(tools/preprocess_data.py). One 1-rank run trains 4 iterations on them, evaluating and saving every 2. From it:
- a resume from iteration 2 with no data flag repeats the uninterrupted run's losses bitwise, and its own
  checkpoint records the data and tokenizer again;
- --skip-train with no data flag reports the run's own last validation loss;
- once the user's folder moved, its data is refused in one line naming it and --data-path, the tokenizer is
  the checkpoint's own copy (one without a copy refuses it, naming --tokenizer-model), and the flags given
  win (one line each says it differs) with the same validation loss;
- HF export -> --load of the HF folder (refused: "convert it first") -> convert back: the checkpoint holds
  the tokenizer, which a moved copy still finds (and an export of it ships); under configs/tiny.yaml its
  --finetune plans (--dry-run) and trains (the preset's model keys yield, one line lists them) bitwise like
  --finetune of the trained checkpoint, which reads the data it was trained on.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megazero.arguments import parse_config
from megazero.checkpoint import storage
from megazero.checkpoint.load import merge_config
from megazero.config import ConfigError
from tests.helpers.launch import launch, run_python
from tests.helpers.text_docs import make_docs
from tests.helpers.tool_module import load_tool

SMALL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "2"]


def _pretrain(tmp, name: str, flags: list[str], ok: bool = True) -> tuple[list[dict], list[dict], str, str]:
    """pretrain_gpt.py on one rank: its iteration records, evaluation records, stdout and stderr."""
    metrics = os.path.join(tmp, f"{name}.jsonl")
    (result,) = launch("pretrain_gpt.py", [*flags, "--metrics-file", metrics], 1)
    if ok:
        assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"
    records = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    return ([r for r in records if "event" not in r], [r for r in records if r.get("event") == "eval"],
            result.stdout, result.stderr if ok else _one_line(result))


def _one_line(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("load_data"))
    user = os.path.join(tmp, "user")
    os.makedirs(user)
    with open(os.path.join(user, "docs.txt"), "w") as fh:
        fh.write("\n".join(make_docs(400)) + "\n")
    tokenizer, data = os.path.join(user, "tok"), os.path.join(user, "corpus")
    for tool in (["tools/train_tokenizer.py", "--input", os.path.join(user, "docs.txt"), "--model-prefix", tokenizer,
                  "--vocab-size", "300", "--model-type", "byte-bpe"],
                 ["tools/preprocess_data.py", "--input", os.path.join(user, "docs.txt"), "--output-prefix", data,
                  "--tokenizer-model", tokenizer]):
        out = run_python(tool)
        assert out.returncode == 0, out.stderr[-2000:]
    ckpt = os.path.join(tmp, "ckpt")
    records, evals, _, _ = _pretrain(tmp, "straight", [*SMALL, "--data-path", data, "--tokenizer-model", tokenizer,
                                                       "--train-iters", "4", "--eval-interval", "2", "--save", ckpt,
                                                       "--save-interval", "2"])
    assert [e["iteration"] for e in evals] == [2, 4]
    return tmp, ckpt, data, tokenizer, records, evals


def test_resume_without_data_flags_continues_on_the_users_data(trained):
    tmp, ckpt, data, tokenizer, records, evals = trained
    again = os.path.join(tmp, "again")
    resumed, resumed_evals, out, _ = _pretrain(tmp, "resumed", [*SMALL, "--train-iters", "4", "--eval-interval", "2",
                                                                "--load", os.path.join(ckpt, "iter_0000002"),
                                                                "--save", again])
    assert [(r["iteration"], r["loss"]) for r in resumed] == [(r["iteration"], r["loss"]) for r in records[2:]]
    assert resumed_evals[-1]["val_loss"] == evals[-1]["val_loss"]
    line = next(x for x in out.splitlines() if "model settings taken from the checkpoint's metadata" in x)
    assert f"data {data} (the checkpoint's" in line and f"tokenizer {tokenizer} (the checkpoint's)" in line, line
    saved = storage.read_metadata(storage.resolve(again))["config"]  # the next checkpoint records them again
    assert (saved["data_path"], saved["tokenizer_model"]) == ([data], tokenizer)


def test_skip_train_reproduces_the_runs_validation_loss(trained):
    tmp, ckpt, _, _, _, evals = trained
    _, got, _, _ = _pretrain(tmp, "skip", [*SMALL, "--load", ckpt, "--skip-train"])
    assert [(e["iteration"], e["val_loss"]) for e in got] == [(4, evals[-1]["val_loss"])]


def test_moved_data_is_refused_in_one_line_and_given_flags_win(trained):
    """Once the user's folder moved: its data is refused, the tokenizer comes from the checkpoint's own copy;
    a checkpoint without a copy (as saved before copies existed) refuses the tokenizer; given flags win."""
    tmp, ckpt, data, tokenizer, _, evals = trained
    user, moved = os.path.dirname(data), os.path.join(tmp, "moved")
    new_tokenizer, new_data = os.path.join(moved, "tok"), os.path.join(moved, "corpus")
    older = os.path.join(tmp, "older", "iter_0000004")
    shutil.copytree(os.path.join(ckpt, "iter_0000004"), older)
    shutil.rmtree(os.path.join(older, "tokenizer"))
    meta = json.load(open(os.path.join(older, "metadata.json")))
    assert meta.pop("tokenizer") == {"path": "tokenizer", "type": "hf"}
    json.dump(meta, open(os.path.join(older, "metadata.json"), "w"))
    os.rename(user, moved)
    try:
        _, _, _, error = _pretrain(tmp, "no-data", [*SMALL, "--load", ckpt, "--skip-train"], ok=False)
        assert f"the checkpoint's data {data}.bin and {data}.idx no longer exists; pass --data-path" in error, error
        _, got, out, _ = _pretrain(tmp, "data-given", [*SMALL, "--load", ckpt, "--skip-train", "--data-path", new_data])
        assert got[-1]["val_loss"] == evals[-1]["val_loss"]
        assert f"tokenizer {os.path.join(ckpt, 'iter_0000004', 'tokenizer')} (the checkpoint's)" in out, out
        assert f"megazero: --data-path {new_data} differs from the checkpoint's ({data}); using the one given" in out

        flags = [*SMALL, "--load", older, "--skip-train", "--data-path", new_data]
        _, _, _, error = _pretrain(tmp, "no-tokenizer", flags, ok=False)
        assert f"tokenizer {tokenizer!r} no longer exists; pass --tokenizer-model" in error, error
        _, got, out, _ = _pretrain(tmp, "given", [*flags, "--tokenizer-model", new_tokenizer])
        assert got[-1]["val_loss"] == evals[-1]["val_loss"]
        assert (f"megazero: --tokenizer-model {new_tokenizer} differs from the checkpoint's ({tokenizer}); using the "
                f"one given") in out
    finally:
        os.rename(moved, user)


@pytest.fixture(scope="module")
def exported(trained):
    """The trained checkpoint exported to HF (with its tokenizer.json)."""
    tmp, ckpt = trained[:2]
    hf = os.path.join(tmp, "hf")
    assert load_tool("convert_checkpoint").main(["--input", ckpt, "--output", hf, "--to", "hf"]) == 0
    return hf


def test_load_of_an_hf_folder_says_convert_it_first(trained, exported):
    tmp, hf = trained[0], exported
    _, _, _, error = _pretrain(tmp, "hf-folder", [*SMALL, "--load", hf, "--finetune"], ok=False)
    assert error == (f"pretrain_gpt.py: error: --load {hf!r} is an HF transformers model folder, not a megazero "
                     f"checkpoint; convert it first: .venv/bin/python tools/convert_checkpoint.py --input {hf} "
                     f"--output {hf}-megazero --to megazero, and pass its --output as --load."), error


def test_hf_round_trip_keeps_the_tokenizer_and_a_preset_yields(trained, exported):
    tmp, ckpt, data, _, _, _ = trained
    convert, hf = load_tool("convert_checkpoint"), exported
    imported, moved = os.path.join(tmp, "imported"), os.path.join(tmp, "imported-moved")
    assert convert.main(["--input", hf, "--output", imported, "--to", "megazero"]) == 0
    os.rename(imported, moved)  # the tokenizer is a copy inside the checkpoint: it moves with it
    meta = storage.read_metadata(storage.resolve(moved))
    assert meta.get("tokenizer") == {"path": "tokenizer", "type": "hf"}
    copy = os.path.join(moved, "iter_0000000", "tokenizer")
    assert open(os.path.join(copy, "tokenizer.json")).read() == open(os.path.join(hf, "tokenizer.json")).read()
    assert os.path.isfile(os.path.join(copy, "tokenizer_config.json"))  # its special tokens, beside it
    assert convert.main(["--input", moved, "--output", os.path.join(tmp, "hf-again"), "--to", "hf"]) == 0
    assert os.path.isfile(os.path.join(tmp, "hf-again", "tokenizer.json"))  # an export of the import ships it
    generated = run_python(["tools/generate.py", "--load", moved, "--prompt", "Hello there", "--max-new-tokens", "2"],
                           timeout=120)
    assert generated.returncode == 0 and generated.stdout.startswith("Hello there"), generated.stderr[-2000:]

    _, _, _, error = _pretrain(tmp, "import-without-data", [*SMALL, "--load", moved, "--finetune"], ok=False)
    assert "records no training data" in error and "pass --data-path" in error, error
    preset = ["--config", "configs/tiny.yaml", "--train-iters", "2", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--eval-iters", "0", "--log-interval", "1", "--finetune"]
    planned = run_python(["pretrain_gpt.py", "--dry-run", *preset, "--load", moved, "--data-path", data,
                          "--memory-budget-gb", "8"], timeout=120)
    assert planned.returncode == 0, planned.stderr[-2000:]  # --dry-run plans the checkpoint's model too
    from_hf, _, out, _ = _pretrain(tmp, "import-finetuned", [*preset, "--load", moved, "--data-path", data])
    assert ("megazero: the checkpoint's model replaces what the --config preset set: --num-layers 2 (the preset's "
            "4), --hidden-size 32 (the preset's 256), --seq-length 16 (the preset's 128)") in out, out
    assert f"tokenizer {copy} (the checkpoint's)" in out
    finetuned, _, _, _ = _pretrain(tmp, "finetuned", [*preset, "--load", ckpt])  # the trained run's data
    assert [r["loss"] for r in from_hf] == [r["loss"] for r in finetuned] and len(finetuned) == 2


def test_typed_model_flags_still_must_agree(tmp_path):
    """Only a preset's setting yields: the same value typed on the command line contradicts the checkpoint."""
    saved = {"config": parse_config(["--arch", "llama", "--num-layers", "2", "--hidden-size", "64",
                                     "--num-attention-heads", "4", "--vocab-size", "300"])[0].to_flat()}
    given = parse_config(["--config", "configs/tiny.yaml", "--load", str(tmp_path)])[0]
    merged = merge_config(saved, given)[0]
    assert (merged.model.arch, merged.model.hidden_size, merged.model.seq_length) == ("llama", 64, 128)
    from megazero.checkpoint.overridable import preset_yield_line  # (new with the split of Config.explicit)

    assert preset_yield_line(given, merged).startswith(
        "megazero: the checkpoint's model replaces what the --config preset set: --arch llama (the preset's gpt2), "
        "--num-layers 2 (the preset's 4), --hidden-size 64 (the preset's 256)")
    with pytest.raises(ConfigError, match=r"^--arch gpt2 contradicts the checkpoint's llama; drop the flag"):
        merge_config(saved, parse_config(["--config", "configs/tiny.yaml", "--load", str(tmp_path),
                                          "--arch", "gpt2"])[0])


def test_merge_data_keeps_what_is_given_and_takes_the_rest(tmp_path):
    """Without a launch: --split and --data-cache-path follow the recorded data; a preset's --split wins; an import
    without a tokenizer reads the built-in corpus (one line says so); a tokenizer too large is not copied."""
    from megazero.checkpoint.recorded_data import copy_hf_tokenizer, merge_data

    for ext in (".bin", ".idx"):
        (tmp_path / f"d{ext}").write_bytes(b"")
    saved = parse_config(["--data-path", str(tmp_path / "d"), "--split", "8,2,0", "--data-cache-path",
                          str(tmp_path / "cache")])[0].to_flat()
    run = {"config": saved, "rng_files": True, "optimizer": {"files": {}}}
    merged, notes = merge_data((str(tmp_path), run), parse_config(["--load", str(tmp_path)])[0])
    assert (merged.data.data_path, merged.data.split, merged.data.data_cache_path) == (
        [str(tmp_path / "d")], "8,2,0", str(tmp_path / "cache")) and notes == []
    yaml = tmp_path / "preset.yaml"
    yaml.write_text("split: 9,1,0\n")
    merged, notes = merge_data((str(tmp_path), run), parse_config(["--config", str(yaml), "--load", str(tmp_path)])[0])
    assert merged.data.split == "9,1,0" and notes == [
        "megazero: --split 9,1,0 differs from the checkpoint's (8,2,0); using the one given"]
    imported = {"config": parse_config([])[0].to_flat(), "rng_files": False, "optimizer": {"files": {}}}
    merged, notes = merge_data((str(tmp_path), imported), parse_config(["--load", str(tmp_path)])[0])
    assert (merged.data.data_path, merged.data.tokenizer_model) == (None, None)
    assert notes[0].endswith("records no data or tokenizer: reading the built-in corpus with its tokenizer (pass "
                             "--data-path and --tokenizer-model for others)"), notes
    told: list[str] = []
    hf_tok = str(tmp_path / "hf")
    assert load_tool("train_tokenizer").main(["--input", str(yaml), "--model-prefix", hf_tok, "--vocab-size", "260",
                                              "--model-type", "byte-bpe"]) == 0
    os.makedirs(tmp_path / "staging")
    assert copy_hf_tokenizer(hf_tok, str(tmp_path / "staging"), 100, told.append) is None
    assert told == [f"note: the tokenizer of {hf_tok} (260 tokens) exceeds the model's vocabulary (100); not recorded"]
