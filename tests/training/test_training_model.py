"""One ``TrainingModel``, built in one place (``build_training_model``), and the checks of a run before its groups
(``prepare_run``), called in-process; rank 0 prints the model at start-up (pretrain_gpt.py through ``launch``)."""
from __future__ import annotations

import pytest
import torch

from megazero.arguments import parse_config
from megazero.checkpoint import storage
from megazero.checkpoint.save import CheckpointContext, save_checkpoint
from megazero.config import ConfigError
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.training.parallelize import build_training_model
from megazero.training.run import prepare_run
from tests.helpers import serial_ckpt
from tests.helpers.launch import launch


def _masters(model) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 master copy of every parameter, by name, assembled from its pieces (flat)."""
    names = {p: n for chunk in model.chunks for n, p in chunk.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for p, lo, views in model.optimizer.state_segments():
        flat = out.setdefault(names[p], torch.full((p.numel(),), float("nan")))
        flat[lo:lo + views["master"].numel()] = views["master"]
    return out


def test_weights_are_loaded_between_the_build_and_the_wrap(tmp_path):
    """bf16: the fp32 master copy is taken from the loaded weights, so they must be in the chunks before the wrap;
    the model holds the engine the optimizer steps and no loss scaler outside fp16."""
    cfg = serial_ckpt.tiny_cfg().updated(bf16=True)
    pstate = ParallelState.serial()
    plan = RunPlan.resolve(cfg, 1)
    saved = build_training_model(cfg, plan, pstate)
    with torch.no_grad():
        for p in saved.chunks[0].parameters():
            p.add_(0.5)  # weights no fresh build starts from
    save_checkpoint(CheckpointContext(str(tmp_path), cfg, plan, pstate, saved, log=lambda _: None), 1, 8)
    folder = storage.resolve(str(tmp_path))
    model = build_training_model(cfg, plan, pstate, weights=(folder, storage.read_metadata(folder)))
    fresh = build_training_model(cfg, plan, pstate)
    want = dict(saved.chunks[0].named_parameters())
    masters, fresh_masters = _masters(model), _masters(fresh)
    assert masters.keys() == want.keys()
    for name, p in model.chunks[0].named_parameters():
        assert torch.equal(p, want[name]), name
        assert masters[name].dtype == torch.float32, name
        assert torch.equal(masters[name], want[name].detach().float().view(-1)), name
        assert not torch.equal(fresh_masters[name], masters[name]), name
    assert model.engine.buffers is model.optimizer.buffers and model.scaler is None
    fp16 = cfg.updated(bf16=False, fp16=True)
    scaled = build_training_model(fp16, RunPlan.resolve(fp16, 1), pstate)
    assert scaled.scaler is not None and scaled.scaler is scaled.optimizer.scaler


def _cfg(*flags: str, model: tuple[str, ...] = ("--num-layers", "2", "--hidden-size", "64", "--seq-length", "32")):
    return parse_config(["--config", "configs/tiny.yaml", *model, *flags])[0]


def test_prepare_run_checks_before_any_group(tmp_path):
    """In-process, no process group: a fresh run is validated, a bad layout refused in one line, a checkpoint
    already at --train-iters leaves nothing to do (its line said), a resume takes the checkpoint's model."""
    said: list[str] = []
    fresh = prepare_run(_cfg(), 1, None, said.append)
    assert fresh is not None and fresh.found is None and fresh.plan.world_size == 1 and not said
    with pytest.raises(ConfigError, match="--tp"):
        prepare_run(_cfg("--tp", "2"), 1, None, said.append)
    root = str(tmp_path / "ckpt")
    serial_ckpt.save(root, 4)  # a 2-layer, 32-wide gpt2 at iteration 4
    assert prepare_run(_cfg("--load", root, "--train-iters", "4", model=()), 1, None, said.append) is None
    assert len(said) == 1 and said[0].startswith("megazero: nothing to do: the checkpoint at iteration 4"), said
    resumed = prepare_run(_cfg("--load", root, "--train-iters", "6", model=()), 1, None, said.append)
    assert resumed is not None and resumed.found is not None and resumed.found[1]["iteration"] == 4
    assert (resumed.cfg.model.hidden_size, resumed.cfg.model.vocab_size) == (32, 200), resumed.cfg.model


def test_rank_0_prints_the_training_model_at_start_up():
    results = launch("pretrain_gpt.py", ["--config", "configs/tiny.yaml", "--num-layers", "2", "--hidden-size", "64",
                                         "--seq-length", "32", "--train-iters", "2", "--eval-interval", "0",
                                         "--zero", "1"], 2)
    assert all(r.returncode == 0 for r in results), results[0].stderr[-3000:] + results[1].stderr[-3000:]
    out = results[0].stdout
    head = "megazero: the training model of rank 0: TrainingModel(zero 1, "
    assert head in out and "once per step, no loss scale)\nchunk 0: GPTModel(" in out, out
    assert "layer 1, recompute=" in out.split(head)[1], out
    assert "TrainingModel(" not in results[1].stdout
