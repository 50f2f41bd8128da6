"""Every preset parses, validates, and documents the parameter count the built model has."""
from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from megazero.arguments import parse_config
from megazero.model.gpt import GPTModel, count_parameters
from megazero.model.transformer import TPContext
from megazero.training.run import validate

PRESETS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))


def documented_count(path: str) -> int:
    match = re.search(r"Parameters: ([\d,]+)", open(path).read())
    assert match, f"{path} does not document its parameter count"
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("path", PRESETS, ids=[os.path.basename(p) for p in PRESETS])
def test_preset_parameter_count(path):
    text = open(path).read()
    assert "offload_path" not in text, f"{path} hard-codes a machine path; the user passes --offload-path"
    disk = "offload_optimizer: disk" in text
    cfg, _ = parse_config(["--config", path, *(["--offload-path", "OFFLOAD_DIR"] if disk else [])])
    if cfg.model.vocab_size is None:
        cfg = cfg.updated(vocab_size=8000)  # the default corpus's tokenizer
    small = documented_count(path) < 20e6
    with torch.device("cpu" if small else "meta"):
        model = GPTModel(cfg.model, TPContext())
    assert count_parameters(model) == documented_count(path)


def test_presets_validate_with_parallel_flags():
    assert len(PRESETS) >= 6
    cfg, _ = parse_config(["--config", "configs/llama-7b.yaml", "--tp", "8", "--pp", "2", "--zero", "1"])
    layout = validate(cfg, world_size=64)
    assert (layout.tp, layout.pp, layout.dp) == (8, 2, 4)
    cfg, _ = parse_config(["--config", "configs/gpt2-small.yaml", "--tp", "4", "--global-batch-size", "64"])
    assert validate(cfg, world_size=8).dp == 2


README_RUNS = [  # (flags after the preset, world): the layouts README.md and docs/ run the presets with
    ("configs/tiny.yaml --tp 2 --pp 2 --zero 2", 8),
    ("configs/tiny.yaml --train-iters 20", 1),
    ("configs/tiny.yaml --tp 2 --save D --load D", 2),
    ("configs/tiny.yaml --tp 2 --pp 2 --zero 2 --train-iters 20 --log-timers --eval-interval 20", 4),
    ("configs/llama-7b.yaml --tp 8 --pp 2 --memory-budget-gb 80", 64),  # the --dry-run line (its --dp 4)
    ("configs/llama-7b.yaml --tp 2 --pp 4 --zero 1", 64),  # the planner's line (its --dp 8)
    ("configs/llama-1.8b-offload.yaml --offload-path OFFLOAD_DIR", 1),
]


@pytest.mark.parametrize("flags,world", README_RUNS, ids=[f for f, _ in README_RUNS])
def test_presets_validate_as_the_docs_run_them(flags, world):
    """A preset's settings count as given (issue 30 refuses a given setting the run ignores): every
    documented command must still validate."""
    cfg, _ = parse_config(["--config", *flags.split()])
    assert validate(cfg, world_size=world).world_size == world
