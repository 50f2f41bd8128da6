"""The trainer drives its optional parts through one interface each, whatever the flags.

One process, the real model, optimizer, schedule and savers (``open_checkpointer`` from the flags): no
--save, a synchronous --save and --async-save train the same losses, the two that save publish the same
tensors and say what ``latest`` names; a wandb run receives each logged record's numbers at its
iteration; a first-step callback (the --compile report) runs once, right after the first step.
"""
from __future__ import annotations

import io
import os
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from megazero.checkpoint.checkpointer import open_checkpointer
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.training.metrics import MetricsLog
from megazero.training.trainer import Trainer
from megazero.training.wandb_log import WandbRun
from tests.helpers import serial_ckpt
from tests.helpers.batches import SyntheticBatches

ITERS, GLOBAL_BATCH = 4, 4


class RecordingRun:
    """Stands in for a ``wandb.init`` run (no network, no files): keeps what it was given."""

    dir = "wandb/offline-run-test/files"  # where wandb would write: the outputs line names its folder
    settings = SimpleNamespace(mode="offline")

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, data))


def _config(root: str | None, async_save: bool = False):
    cfg, pstate, model = serial_ckpt.build()
    cfg = cfg.updated(train_iters=ITERS, global_batch_size=GLOBAL_BATCH, micro_batch_size=2, log_interval=1,
                      save=root, save_interval=2, async_save=async_save)
    return cfg, pstate, model


def _train(root: str | None, async_save: bool = False, batches: SyntheticBatches | None = None,
           lines: io.StringIO | None = None, **parts) -> list[float]:
    """The losses of a short run (its lines into ``lines``); ``root`` None: no --save."""
    torch.manual_seed(0)  # the checkpoints hold the generators' states: every run starts from the same
    cfg, pstate, model = _config(root, async_save)
    plan = RunPlan.resolve(cfg, 1)
    checkpointer = open_checkpointer(cfg, plan, pstate, model)
    trainer = Trainer(cfg, pstate, model, build_schedule(plan), batches or SyntheticBatches(cfg, 0, 1),
                      MetricsLog(None, enabled=True, stream=lines or io.StringIO()), checkpointer=checkpointer, **parts)
    return [r["loss"] for r in trainer.train()]


def _tensors(folder: str) -> dict[str, dict[str, torch.Tensor]]:
    return {name: load_file(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if name.endswith(".safetensors")}


def test_no_save_sync_and_async_train_alike_and_publish_the_same_files(tmp_path, capsys):
    roots = {kind: str(tmp_path / kind) for kind in ("none", "sync", "async")}
    lines = io.StringIO()  # the trainer's lines; the savers print theirs
    losses = {"none": _train(None, lines=lines), "sync": _train(roots["sync"], lines=lines),
              "async": _train(roots["async"], async_save=True, lines=lines)}
    out = capsys.readouterr().out + lines.getvalue()
    assert losses["none"] == losses["sync"] == losses["async"] and len(losses["none"]) == ITERS, losses
    assert not os.path.exists(roots["none"])  # no --save: the null checkpointer writes nothing
    for kind in ("sync", "async"):
        assert sorted(os.listdir(roots[kind])) == ["iter_0000002", "iter_0000004", "latest"], kind
        assert f"'latest' in {roots[kind]} names iter_0000004" in out, out  # the summary reads it from disk
    assert f"megazero: saved checkpoint {roots['sync']}/iter_0000004 (" in out, out
    assert f"megazero: --async-save published checkpoint {roots['async']}/iter_0000004 (" in out, out
    for iteration in ("iter_0000002", "iter_0000004"):
        sync, background = (_tensors(os.path.join(roots[k], iteration)) for k in ("sync", "async"))
        assert sync.keys() == background.keys() and sync, (sync.keys(), background.keys())
        for name, tensors in sync.items():
            assert tensors.keys() == background[name].keys(), name
            assert all(torch.equal(t, background[name][k]) for k, t in tensors.items()), name


def test_wandb_gets_each_records_numbers_and_the_first_step_callback_runs_once():
    run, seen = RecordingRun(), []
    batches = SyntheticBatches(_config(None)[0], 0, 1)
    losses = _train(None, batches=batches, wandb=WandbRun(run),
                    on_first_step=[lambda: seen.append(batches.consumed_samples)])
    assert seen == [GLOBAL_BATCH]  # once, after the first step took its batch and before the second
    assert [step for step, _ in run.logged] == list(range(1, ITERS + 1))
    assert [data["loss"] for _, data in run.logged] == losses
    assert all(isinstance(v, (int, float)) for _, data in run.logged for v in data.values())
    assert "comm_bytes" not in run.logged[0][1]  # a dict per collective kind: not a number wandb can plot
