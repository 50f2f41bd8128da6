"""RunPlan: the derived facts of a run, checked against hand arithmetic; frozen config; errors name flags."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megazero.config import Config, ConfigError
from megazero.parallel.layout import Layout
from megazero.run_plan import RunPlan, ZeroStage

MODEL = {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32}


def _cfg(tp: int = 1, pp: int = 1, **settings) -> Config:
    return Config.from_flat({**MODEL, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                             **settings})


def test_interleaved_tp_sp_layout():
    # tp 2 x dp 2 x pp 2: m = 16 / (2 x 2) = 4 (divisible by pp); 8 layers / (pp 2 x vp 2) = 2 per chunk;
    # SP cuts the sequence: [32 / 2, 2, 64]; vocab 300 pads to a multiple of 128 x 2 = 256 -> 512.
    cfg = _cfg(tp=2, pp=2, virtual_pipeline_size=2, sequence_parallel=True, micro_batch_size=2,
               global_batch_size=16, vocab_size=300, zero=1)
    plan = RunPlan.resolve(cfg, 8)
    assert (plan.tp, plan.pp, plan.dp, plan.world_size) == (2, 2, 2, 8)
    assert (plan.virtual_stages, plan.schedule, plan.micro_batches) == (2, "interleaved", 4)
    assert plan.stage_shape == (16, 2, 64)
    assert (plan.compute_dtype, plan.main_grads_dtype) == (torch.float32, torch.float32)
    assert (plan.vocab_size, plan.padded_vocab_size) == (300, 512)
    assert plan.zero is ZeroStage.OPTIMIZER_STATE and plan.zero.shards_optimizer_state
    assert not plan.zero.shards_gradients and not plan.zero.shards_parameters
    assert plan.layout_record() == {"tp": 2, "cp": 1, "pp": 2, "dp": 2, "ep": 1, "etp": 2, "zero": 1,
                                   "virtual_stages": 2}


def test_data_parallel_only_bf16_zero2():
    # dp 4: m = 32 / (2 x 4) = 4; pp = 1 runs no pipeline; the vocabulary is not known yet.
    cfg = _cfg(zero=2, bf16=True, main_grads_dtype="bf16", micro_batch_size=2, global_batch_size=32)
    plan = RunPlan.resolve(cfg, 4)
    assert (plan.dp, plan.micro_batches, plan.schedule, plan.virtual_stages) == (4, 4, "no-pipelining", 1)
    assert plan.stage_shape == (32, 2, 64)
    assert (plan.compute_dtype, plan.main_grads_dtype) == (torch.bfloat16, torch.bfloat16)
    assert plan.zero is ZeroStage.GRADIENTS and plan.zero.shards_gradients
    assert (plan.vocab_size, plan.padded_vocab_size) == (None, None)


def test_gpipe_tp4_fp16():
    # tp 4 x pp 4, dp 1: m = 16 / 4 = 4; no SP so the full sequence; vocab 1000 -> multiple of 512 -> 1024.
    cfg = _cfg(tp=4, pp=4, pipeline_schedule="gpipe", fp16=True, vocab_size=1000)
    plan = RunPlan.resolve(cfg, 16)
    assert (plan.dp, plan.micro_batches, plan.schedule, plan.virtual_stages) == (1, 4, "gpipe", 1)
    assert plan.stage_shape == (32, 4, 64)
    assert (plan.compute_dtype, plan.main_grads_dtype) == (torch.float16, torch.float32)
    assert plan.padded_vocab_size == 1024 and plan.zero is ZeroStage.NONE


def test_config_and_plan_are_frozen():
    cfg = _cfg(vocab_size=300)
    plan = RunPlan.resolve(cfg, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.hidden_size = 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.explicit = frozenset()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.micro_batches = 2


def test_updated_revalidates_and_the_plan_follows():
    cfg = _cfg(vocab_size=300)
    bigger = cfg.updated(vocab_size=700, lr=1e-3)
    assert (bigger.model.vocab_size, bigger.optimizer.lr, cfg.model.vocab_size) == (700, 1e-3, 300)
    assert bigger.model.hidden_size == 64 and bigger.training == cfg.training  # untouched sections kept
    assert RunPlan.resolve(bigger, 1).padded_vocab_size == 768
    with pytest.raises(ConfigError, match="--hidden-size"):
        cfg.updated(hidden_size=66)  # not divisible by 4 heads: __post_init__ ran again
    with pytest.raises(ConfigError, match="--min-lr"):
        dataclasses.replace(cfg.optimizer, min_lr=1.0)
    with pytest.raises(ConfigError, match="unknown setting 'hiden_size'"):
        cfg.updated(hiden_size=64)
    explicit = Config.from_flat({"lr": 0.1}, explicit=frozenset({"lr"}))
    assert explicit.explicit == {"lr"} and explicit.updated(seed=3).explicit == {"lr"}


@pytest.mark.parametrize("settings,world,words", [
    ({"tp": 3}, 3, "--tensor-model-parallel-size (3)"),
    ({"global_batch_size": 12, "micro_batch_size": 4}, 2, "--global-batch-size (12)"),
    ({"pp": 3}, 4, "--tp 1 x --pp 3"),  # the world does not factor into the config's tp x pp
    ({"pp": 2, "virtual_pipeline_size": 2, "global_batch_size": 6, "micro_batch_size": 2}, 2,
     "micro-batches per step (3 = --global-batch-size 6"),
    ({"sequence_parallel": True, "tp": 4, "seq_length": 30, "hidden_size": 64, "num_attention_heads": 4}, 4,
     "--seq-length (30)"),
])
def test_errors_name_the_flag(settings, world, words):
    cfg = _cfg(**settings)
    with pytest.raises(ConfigError) as err:
        RunPlan.resolve(cfg, world)
    assert words in str(err.value), str(err.value)


def test_world_that_does_not_factor_names_tp_and_pp():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by --tp 4 x --pp 1"):
        Layout.from_world(6, 4, 1)


def test_zero3_gathering_from_flags():
    """--zero 3 resolves how units gather; the flags parse from the command line; other stages have none."""
    from megazero.arguments import parse_config
    cfg, _ = parse_config(["--zero", "3", "--zero3-prefetch", "2", "--zero3-unit-layers", "4",
                        "--no-reshard-after-forward", "--num-layers", "8"])
    plan = RunPlan.resolve(cfg, 2)
    assert plan.zero is ZeroStage.PARAMETERS and plan.zero.shards_parameters and plan.zero.shards_gradients
    g = plan.gathering
    assert (g.layers_per_unit, g.prefetch, g.reshard_after_forward) == (4, 2, False)
    assert plan.layout_record()["zero"] == 3
    assert RunPlan.resolve(_cfg(zero=2), 2).gathering is None


@pytest.mark.parametrize("settings,words", [({"zero": 4}, "--zero must be 0, 1, 2 or 3"),
                                            ({"zero3_prefetch": -1}, "--zero3-prefetch must be >= 0"),
                                            ({"zero3_unit_layers": 0}, "--zero3-unit-layers must be >= 1")])
def test_zero3_bad_flags_name_the_flag(settings, words):
    with pytest.raises(ConfigError, match=words):
        _cfg(**settings)
