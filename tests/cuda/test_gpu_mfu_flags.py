"""bench/gpu_mfu.py's flags for the OLMoE-1B-7B run (bench/RESULTS_gpu.md), checked on the CPU without a run:

- a flag the benchmark does not define reaches the run's config after the benchmark's own, so it wins
  (``--bf16`` over the CPU's ``--no-bf16``); a misspelt one ends in pretrain_gpt.py's usage error;
- ``--device-init`` draws ``initialize_parameters``' distributions (the constants where set, zero padded
  vocabulary rows, normal(0, std) elsewhere, experts' std included), and puts the seeded initialiser back.
"""
from __future__ import annotations

import os

import pytest
import torch

from bench.gpu_mfu import _draw_on_device, build_config, parse_args, weights_drawn_on_device
from megazero.arguments import parse_config
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.pipeline import partition
from megazero.tensor_parallel.layers import initialize_parameters, materialize, spec_of
from tests.helpers.launch import ROOT

MOE_TINY = os.path.join(ROOT, "configs", "moe-tiny.yaml")


def test_unknown_flags_reach_the_run_and_win():
    args = parse_args(["--device", "cpu", "--config", MOE_TINY, "--micro-batch-size", "2", "--grad-accum", "3",
                       "--bf16", "--main-grads-dtype", "bf16", "--recompute", "full"])
    t = build_config(args).training
    assert (t.bf16, t.main_grads_dtype, t.recompute) == (True, "bf16", "full")
    assert (t.micro_batch_size, t.global_batch_size) == (2, 6)
    with pytest.raises(SystemExit):
        build_config(parse_args(["--device", "cpu", "--config", MOE_TINY, "--main-grad-dtype", "bf16"]))


def test_device_init_draws_the_seeded_distributions():
    cfg = parse_config(["--config", MOE_TINY, "--vocab-size", "8000", "--hidden-size", "256"])[0].model
    with torch.device("meta"):
        model = GPTModel(cfg, TPContext(), padded_vocab=8064)
    materialize(model, "cpu", torch.float32)
    _draw_on_device(model, seed=1, tp_group=None)
    experts = 0
    for name, param in model.named_parameters():
        spec, param = spec_of(param), param.detach()
        if spec.init_std is None:
            assert torch.all(param == spec.init_value), name
            continue
        valid = param[:spec.valid_rows] if spec.valid_rows is not None else param
        if spec.valid_rows is not None:
            assert torch.all(param[spec.valid_rows:] == 0), name
        assert valid.mean().abs() < 0.1 * spec.init_std, name
        assert valid.std().item() == pytest.approx(spec.init_std, rel=0.05), name
        experts += spec.expert
    assert experts == 3 * cfg.num_layers  # fc1, gate and fc2 of every MoE layer were drawn


def test_device_init_puts_the_seeded_initialiser_back():
    with weights_drawn_on_device(False):
        assert partition.initialize_parameters is initialize_parameters
    with pytest.raises(RuntimeError), weights_drawn_on_device(True):
        assert partition.initialize_parameters is _draw_on_device
        raise RuntimeError("a failed run")
    assert partition.initialize_parameters is initialize_parameters
