"""The mixture-of-experts presets: total and active parameters of the built model, the published headlines,
and the layouts their comments launch.

Active parameters are what one token runs through: the built model's count less E - k of the E experts of
every MoE layer, counted from the expert weights of the model built on the meta device (``ParamSpec.expert``),
not from the planner's arithmetic (which must agree: ``memory/experts.py``).
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from megazero.arguments import parse_config
from megazero.memory import num_parameters
from megazero.memory.experts import inactive_params
from megazero.model.gpt import GPTModel, count_parameters
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import spec_of
from megazero.training.run import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# preset -> (published total, published active, in billions as printed: Mistral AI rounds, Qwen truncates (3.35
# to 3.3); the layout its comment runs)
PRESETS = {"moe-tiny.yaml": (None, None, ("--tp 2 --ep 2 --pp 2 --zero 3", 8)),
           "mixtral-8x7b.yaml": (46.7, 12.9, ("--tp 2 --pp 4 --ep 8 --etp 1 --zero 1", 128)),
           "qwen3-30b-a3b.yaml": (30.5, 3.3, ("--pp 2 --ep 8 --zero 1", 64)),
           "olmoe-1b-7b.yaml": (6.9, 1.3, ("--ep 8 --zero 1", 8))}


def _documented(text: str, what: str) -> int:
    match = re.search(rf"^# {what}: ([\d,]+)", text, re.MULTILINE)
    assert match, f"the preset does not document its {what.lower()}"
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_total_and_active_parameters_of_the_built_model(name):
    path = os.path.join(ROOT, "configs", name)
    cfg, _ = parse_config(["--config", path])
    model_cfg = cfg.model if cfg.model.vocab_size else cfg.updated(vocab_size=8000).model  # the corpus's tokenizer
    with torch.device("meta"):
        model = GPTModel(model_cfg, TPContext())
    total = count_parameters(model)
    experts = sum(p.numel() for p in model.parameters() if spec_of(p).expert)
    assert model_cfg.num_experts is not None and experts > 0
    active = total - experts * (model_cfg.num_experts - model_cfg.moe_router_topk) // model_cfg.num_experts
    text = open(path).read()
    assert (_documented(text, "Parameters"), _documented(text, "Active parameters")) == (total, active)
    assert (num_parameters(model_cfg), num_parameters(model_cfg) - inactive_params(model_cfg)) == (total, active)
    published_total, published_active, _ = PRESETS[name]
    if published_total is not None:
        for count, printed in ((total, published_total), (active, published_active)):
            assert printed in (round(count / 1e9, 1), int(count / 1e8) / 10), (name, count, printed)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_commented_layout_validates(name):
    flags, world = PRESETS[name][2]
    path = os.path.join(ROOT, "configs", name)
    assert flags in open(path).read()
    cfg, _ = parse_config(["--config", path, *flags.split()])
    layout = validate(cfg.updated(vocab_size=cfg.model.vocab_size or 8000), world_size=world)
    assert layout.world_size == world and layout.ep == int(flags.split("--ep ")[1].split()[0])
