"""Every value reaches the run as its field's declared type, within its declared choices, or is refused in one line.

Issue 30: YAML 1.1 reads ``3e-4`` (a float without a dot) as a string, so a preset's ``lr: 3e-4`` passed
validation and died mid-run, and ``min_lr: 3e-5`` "exceeded" ``lr: 3e-4`` as strings; a preset's
``lr_decay_style: exp`` trained with another schedule and ``cp_comm_type: ring`` failed only at the first
attention. Flags are typed by argparse; YAML values and Python callers of ``Config.from_flat`` go through
the same field check, so all three are covered here.
"""
from __future__ import annotations

import json

import pytest

from megazero.arguments import parse_config
from megazero.config import Config, ConfigError
from megazero.optimizer.lr import LRSchedule
from tests.helpers.launch import ROOT, launch, run_python


def _from_yaml(tmp_path, text: str, *flags: str) -> Config:
    path = tmp_path / "preset.yaml"
    path.write_text(text + "\n")
    return parse_config(["--config", str(path), *flags])[0]


WRONG_TYPE = [  # (YAML line, the one line's start)
    ("num_layers: 2.5", "--num-layers must be an integer, got 2.5 (float)"),
    ("num_layers: true", "--num-layers must be an integer, got True (bool)"),
    ("zero: 1.5", "--zero must be an integer"),
    ("seed: twelve", "--seed must be an integer, got 'twelve' (str)"),
    ("lr: abc", "--lr must be a number, got 'abc' (str)"),
    ("lr: [1.0e-3]", "--lr must be a number, got [0.001] (list)"),
    ("lr:", "--lr must be a number, got None"),
    ("lr: true", "--lr must be a number, got True (bool)"),
    ("bf16: 'yes'", "--bf16 must be true or false, got 'yes' (str)"),
    ("sequence_parallel: 1", "--sequence-parallel must be true or false, got 1 (int)"),
    ("split: 1", "--split must be a string, got 1 (int)"),
    ("tokenizer_model: [a, b]", "--tokenizer-model must be a string"),
    ("data_path: {a: 1}", "--data-path must be a list of strings (or one string)"),
    ("tensor_model_parallel_size: 1.5", "--tensor-model-parallel-size/--tp must be an integer, got 1.5"),
]


@pytest.mark.parametrize("line,words", WRONG_TYPE, ids=[line for line, _ in WRONG_TYPE])
def test_wrong_type_in_a_preset_is_one_line_naming_the_flag(tmp_path, line, words):
    with pytest.raises(ConfigError) as err:
        _from_yaml(tmp_path, line)
    text = str(err.value)
    assert text.startswith(words) and "\n" not in text, text


BAD_CHOICE = [  # (YAML line, the one line)
    ("lr_decay_style: exp", "--lr-decay-style must be constant, linear, cosine or wsd, got 'exp'"),
    ("cp_comm_type: ring", "--cp-comm-type must be p2p, a2a or a2a+p2p, got 'ring'"),
    ("arch: gpt3", "--arch must be gpt2 or llama, got 'gpt3'"),
    ("zero: 4", "--zero must be 0, 1, 2 or 3, got 4"),
    ("recompute: some", "--recompute must be none, selective, full or auto, got 'some'"),
    ("offload_optimizer: gpu", "--offload-optimizer must be none, cpu or disk, got 'gpu'"),
    ("device: gpu", "--device must be auto, cpu or cuda, got 'gpu'"),
    ("pipeline_schedule: zb", "--pipeline-schedule must be gpipe, 1f1b or interleaved, got 'zb'"),
    ("main_grads_dtype: fp16", "--main-grads-dtype must be fp32 or bf16, got 'fp16'"),
    ("compile_backend: cudagraphs", "--compile-backend must be inductor, aot_eager or eager, got 'cudagraphs'"),
    ("wandb_mode: dryrun", "--wandb-mode must be online, offline or disabled, got 'dryrun'"),
    ("rope_scaling_type: dynamic", "--rope-scaling-type must be llama3 or yarn, got 'dynamic'"),
]


@pytest.mark.parametrize("line,words", BAD_CHOICE, ids=[line for line, _ in BAD_CHOICE])
def test_value_outside_the_choices_is_refused_where_the_config_is_built(tmp_path, line, words):
    """From a preset (argparse checks only the flags), and from a Python caller, alike."""
    for build in (lambda: _from_yaml(tmp_path, line), lambda: Config.from_flat(dict([line.split(": ")]))):
        with pytest.raises(ConfigError) as err:
            build()
        assert str(err.value).startswith(words) and "\n" not in str(err.value), str(err.value)


def test_unambiguous_values_are_converted_to_the_field_type(tmp_path):
    cfg = _from_yaml(tmp_path, "\n".join([
        "lr: 3e-4", "min_lr: 3e-5",  # YAML 1.1: strings
        "hidden_dropout: 0",  # an int for a float field
        "bucket_size: 1.0e+7",  # an integral float for an int field
        "seed: '42'",  # a quoted number
        "bf16: yes",  # YAML 1.1's boolean
        "data_path: 0.3 a 0.7 b",  # one string, as the flag takes its words
    ]))
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr) == (3e-4, 3e-5)
    assert type(cfg.optimizer.lr) is float and type(cfg.model.hidden_dropout) is float
    assert (cfg.parallel.bucket_size, cfg.training.seed) == (10_000_000, 42)
    assert type(cfg.parallel.bucket_size) is int and cfg.training.bf16 is True
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    assert Config.from_flat({"data_path": [0.3, "a", 1, "b"]}).data.data_path == ["0.3", "a", "1", "b"]
    assert type(Config.from_flat({"lr": 1}).optimizer.lr) is float


def test_flags_override_a_preset_and_keep_their_types(tmp_path):
    cfg = _from_yaml(tmp_path, "lr: 3e-4\nmin_lr: 3e-5", "--lr", "1e-3")
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.min_lr == 3e-5


def test_a_preset_with_a_float_written_without_a_dot_trains(tmp_path):
    """The issue's preset, as a user runs it: two steps whose logged LR is the float schedule's."""
    preset, metrics = tmp_path / "lr.yaml", tmp_path / "m.jsonl"
    preset.write_text("arch: gpt2\nnum_layers: 1\nhidden_size: 32\nnum_attention_heads: 2\nseq_length: 16\n"
                      "micro_batch_size: 2\nglobal_batch_size: 2\ntrain_iters: 2\nlr: 3e-4\nmin_lr: 3e-5\n"
                      "lr_decay_style: linear\nlog_interval: 1\ndevice: cpu\n")
    r = run_python(["pretrain_gpt.py", "--config", str(preset), "--metrics-file", str(metrics)],
                   env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    logged = [row["lr"] for row in map(json.loads, metrics.read_text().splitlines()) if "iteration" in row]
    flags, _ = parse_config(["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "linear", "--train-iters", "2"])
    schedule = LRSchedule(flags.optimizer, 2)
    assert logged == [schedule(1), schedule(2)] and logged[-1] == pytest.approx(3e-5), logged


def test_a_bad_preset_stops_every_rank_in_one_line(tmp_path):
    """An unknown choice and a misspelled key in a YAML preset: every rank of a 2-rank run exits 2 before any
    process group exists, with the one line naming the field and no traceback."""
    for text, words in (("lr_decay_style: exp", "--lr-decay-style must be constant, linear, cosine or wsd"),
                        ("hiden_size: 64", "unknown setting 'hiden_size'")):
        path = tmp_path / "preset.yaml"
        path.write_text(text + "\n")
        results = launch("pretrain_gpt.py", ["--config", str(path)], 2, timeout=120)
        assert [r.returncode for r in results] == [2, 2], [r.stderr[-500:] for r in results]
        errors = [line for r in results for line in r.stderr.splitlines() if line.strip()]
        assert errors and all(words in line and "Traceback" not in line for line in errors), errors
