"""Refusals a user met combining features from a preset and the command line (a CLI shake-out, 2026-11-27).

Each line must name the flag to pass, in the spelling the command line takes: ``--no-compile`` (the
message once said "pass no --compile"), and ``--moe-aux-loss-coeff 0`` where the coefficient came from
configs/moe-tiny.yaml rather than from the command (the message once said "drop the coefficient", which
a user who never typed it cannot do). A checkpoint converted from HF Mixtral resumes under the preset that
trained the model (the experts' width was compared by its spelling, not its meaning), and
convert_checkpoint.py names its own --input when that folder holds no checkpoint. A resume that drops the
document-masking switches is told so, and --dry-run of configs/tiny.yaml plans the default corpus's vocabulary.
"""
from __future__ import annotations

import subprocess

import pytest

from megazero.arguments import parse_config
from megazero.checkpoint.load import merge_config
from megazero.checkpoint.overridable import document_change_line
from megazero.config import ConfigError
from megazero.run_plan import RunPlan
from tests.helpers.launch import ROOT, run_python
from tests.helpers.tool_module import load_tool


def _refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        RunPlan.resolve(parse_config(argv)[0], 1)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("switch", ["--reset-position-ids", "--reset-attention-mask"])
def test_document_masks_with_compile_name_the_flag_to_pass(switch):
    message = _refusal(["--config", "configs/tiny.yaml", switch, "--compile"])
    assert message == (f"{switch} only applies with --no-compile (here --compile); drop it or pass --no-compile.")


def test_a_preset_aux_loss_coefficient_without_a_balancing_loss_names_the_flag_that_zeroes_it():
    message = _refusal(["--config", "configs/moe-tiny.yaml", "--moe-router-load-balancing-type", "none",
                        "--moe-router-enable-expert-bias"])
    assert message.startswith("--moe-aux-loss-coeff 0.01 needs a balancing loss"), message
    assert "--moe-aux-loss-coeff 0 " in message, message
    # the flag it names is accepted: the same command with it passes
    parse_config(["--config", "configs/moe-tiny.yaml", "--moe-router-load-balancing-type", "none",
                  "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff", "0"])


def test_a_mixtral_import_resumes_under_the_preset_that_trained_it(tmp_path):
    """An HF Mixtral converted to megazero records its experts' width as --ffn-hidden-size (no
    --moe-ffn-hidden-size); configs/moe-tiny.yaml names it as --moe-ffn-hidden-size 256, the same model."""
    imported = parse_config(["--config", "configs/moe-tiny.yaml", "--ffn-hidden-size", "256"])[0].to_flat()
    imported["moe_ffn_hidden_size"] = None
    given = parse_config(["--config", "configs/moe-tiny.yaml", "--load", str(tmp_path)])[0]
    merged = merge_config({"config": imported}, given)[0]  # before: "... contradicts the checkpoint's None"
    assert merged.model.moe_ffn_size == 256
    with pytest.raises(ConfigError, match=r"^--moe-ffn-hidden-size 128 contradicts the checkpoint's None \(i\.e\. "
                                          r"moe_ffn_size 256\); drop the flag"):
        merge_config({"config": imported}, parse_config(["--config", "configs/moe-tiny.yaml", "--load", str(tmp_path),
                                                         "--moe-ffn-hidden-size", "128"])[0])


def test_convert_names_its_own_flag_for_a_folder_without_a_checkpoint(tmp_path, capsys):
    """convert_checkpoint.py takes the checkpoint as --input; its refusal once said '--load ... holds no checkpoint'."""
    code = load_tool("convert_checkpoint").main(["--input", str(tmp_path), "--output", str(tmp_path / "hf"),
                                                 "--to", "hf"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (f"convert_checkpoint.py: error: --input {str(tmp_path)!r} holds no checkpoint (no latest file and "
                   f"no metadata.json); pass the --save folder of an earlier run."), err


DOC = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def test_a_resume_without_the_document_switches_is_told_so(tmp_path):
    """A checkpoint saved under document masking, resumed with only --load (the model flags come from the
    checkpoint, the data switches do not): the run once trained without the masks and said nothing."""
    saved = {"config": parse_config(["--config", "configs/tiny.yaml", *DOC])[0].to_flat()}
    bare = merge_config(saved, parse_config(["--load", str(tmp_path), "--eod-mask-loss"])[0])[0]
    assert document_change_line(saved, bare) == (
        "megazero: document masking differs from the run that saved the checkpoint: --no-reset-position-ids (the "
        "checkpoint's run: --reset-position-ids), --no-reset-attention-mask (the checkpoint's run: "
        "--reset-attention-mask); pass the same switches to keep its objective")
    again = merge_config(saved, parse_config(["--load", str(tmp_path), *DOC])[0])[0]
    assert document_change_line(saved, again) is None


def _dry_run(*flags: str) -> subprocess.CompletedProcess:
    return run_python(["pretrain_gpt.py", "--dry-run", *flags], timeout=120,
                      env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_dry_run_of_the_tiny_preset_plans_the_default_corpus_vocabulary():
    """configs/tiny.yaml trains on the default corpus; its --dry-run was refused with 'the memory plan needs the
    vocabulary: pass --vocab-size (or --tokenizer-model)' though a run knows it: the same plan as --vocab-size 8000."""
    given = ["--config", "configs/tiny.yaml", "--memory-budget-gb", "80"]
    implied, explicit = _dry_run(*given), _dry_run(*given, "--vocab-size", "8000")
    assert implied.returncode == 0, implied.stderr
    assert explicit.returncode == 0 and "model: gpt2, 0.005 B parameters" in explicit.stdout, explicit.stderr
    assert implied.stdout == explicit.stdout


def test_dry_run_with_own_data_and_no_tokenizer_assumes_no_vocabulary(tmp_path):
    """--data-path without --tokenizer-model is refused by a run, so its plan must not assume the default
    corpus's 8000 tokens: it asks for the vocabulary instead."""
    got = _dry_run("--config", "configs/tiny.yaml", "--data-path", str(tmp_path / "mine_text_document"))
    assert got.returncode != 0
    assert "the memory plan needs the vocabulary: pass --vocab-size (or --tokenizer-model)." in got.stderr, got.stderr
