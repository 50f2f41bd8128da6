"""Three runs into one metrics file can be told apart, and what each says about itself is true.

Real pretrain_gpt.py processes on gloo, one rank each, all writing the same --metrics-file: run "a" trains
with --save until a SIGINT (its --log-interval logs nothing before the stop); run "b" resumes a's checkpoint
(the same run: a's run id); run "c" is a fresh MoE run into the same file (a new run id) with TensorBoard,
--timeline and offline wandb. Checked: the stop's done line, the run_start records and the checkpoints' run
ids, the plotter's latest-run default, --all-runs and MoE panel, the TensorBoard groups and config text, and
the outputs line. The ETA's first-step rule and the --log-timers help are checked in-process.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from megazero.arguments import build_parser
from megazero.checkpoint import storage
from megazero.training.progress import Progress
from megazero.training.run_identity import RunIdentity
from tests.helpers import serial_ckpt
from megazero.parallel.state import free_port
from tests.helpers.launch import ROOT, launch
from tests.helpers.tool_module import load_tool
from tests.helpers.signals import signal_when

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

DENSE = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
         "--lr-warmup-iters", "1"]
MOE = ["--config", "configs/moe-tiny.yaml", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
       "--moe-ffn-hidden-size", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1"]
GUARD = 300  # seconds: a hang guard for the subprocesses, not a timing assertion


def _signalled_run(tmp, metrics) -> tuple[str, str]:
    """Run "a": trains until a SIGINT sent once its first checkpoint (iteration 2) is published; (stdout, stderr)."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    args = [*DENSE, "--train-iters", "100000", "--log-interval", "1000", "--save-interval", "2",
            "--save", str(tmp / "ckpt"), "--metrics-file", str(metrics)]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = signal_when(proc, (tmp / "ckpt" / "latest").exists, signal.SIGINT, GUARD)
    assert proc.returncode == 0, err[-3000:]
    return out, err


class Runs(NamedTuple):
    tmp: Path
    metrics: Path  # the one metrics file of a, b and c
    records: list[dict]  # all of it, after c
    a_records: list[dict]  # what it held when a had stopped
    stopped: int  # the iteration a stopped at
    stdout: dict[str, str]  # by run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("starts")
    metrics = tmp / "logs" / "metrics.jsonl"
    a_out, _ = _signalled_run(tmp, metrics)
    a_records = [json.loads(line) for line in open(metrics).read().splitlines()]
    stopped = int(re.search(r"stopped by signal after iteration (\d+)", a_out).group(1))
    b = launch("pretrain_gpt.py", [*DENSE, "--train-iters", str(stopped + 2), "--log-interval", "1", "--load",
                                   str(tmp / "ckpt"), "--save", str(tmp / "ckpt"), "--metrics-file", str(metrics)],
               1, timeout=GUARD)[0]
    assert b.returncode == 0, b.stderr[-3000:]
    c = launch("pretrain_gpt.py", [*MOE, "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                                   "--metrics-file", str(metrics), "--tensorboard-dir", str(tmp / "tb"),
                                   "--timeline", str(tmp / "trace.json"), "--wandb-project", "starts",
                                   "--wandb-mode", "offline", "--wandb-dir", str(tmp / "wb")], 1, timeout=GUARD)[0]
    assert c.returncode == 0, c.stderr[-3000:]
    records = [json.loads(line) for line in open(metrics).read().splitlines()]
    return Runs(tmp, metrics, records, a_records, stopped, {"a": a_out, "b": b.stdout, "c": c.stdout})


def _starts(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "run_start"]


def _runs_by_start(records: list[dict]) -> list[list[dict]]:
    """The iteration records after each run_start record, one list per start."""
    parts: list[list[dict]] = []
    for r in records:
        if r.get("event") == "run_start":
            parts.append([])
        elif "event" not in r:
            parts[-1].append(r)
    return parts


def test_a_signalled_run_says_the_iteration_it_stopped_and_saved_at(runs):
    tmp, stopped, stdout = runs.tmp, runs.stopped, runs.stdout
    a = [r for r in runs.a_records if "event" not in r]
    assert [r["iteration"] for r in a] == [stopped]  # --log-interval 1000: the stop's iteration is recorded
    done = next(line for line in stdout["a"].splitlines() if line.startswith("megazero: done:"))
    assert done.startswith(f"megazero: done: {stopped} iterations (now at {stopped}/100000), "), done
    assert done.endswith(f"; final lm loss {a[-1]['loss']:.6E}"), done
    assert (tmp / "ckpt" / "latest").read_text().strip() != storage.iteration_dir(stopped)  # b went on from it
    assert storage.read_metadata(str(tmp / "ckpt" / storage.iteration_dir(stopped)))["iteration"] == stopped


def test_each_start_is_marked_and_a_resume_continues_the_run_id(runs):
    tmp, records, stopped, stdout = runs.tmp, runs.records, runs.stopped, runs.stdout
    a, b, c = _starts(records)
    assert set(a) == {"event", "run_id", "continues", "started_at", "start_iteration", "world_size", "layout",
                      "config"} and a["world_size"] == 1 and "iteration" not in a
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", a["run_id"]) and a["started_at"].endswith("Z")
    assert a["run_id"] == b["run_id"] != c["run_id"]
    assert a["continues"] is None and c["continues"] is None
    assert b["continues"] == str(tmp / "ckpt" / storage.iteration_dir(stopped))
    assert (a["start_iteration"], b["start_iteration"], c["start_iteration"]) == (0, stopped, 0)
    assert a["config"]["training"]["train_iters"] == 100000 and b["config"]["training"]["train_iters"] == stopped + 2
    assert c["config"]["model"]["num_experts"] == 8 and c["layout"]["tp"] == 1
    for name in (storage.iteration_dir(stopped), storage.iteration_dir(stopped + 2)):  # b saves under a's id
        assert storage.read_metadata(str(tmp / "ckpt" / name))["run_id"] == a["run_id"]
    assert f"megazero: run {a['run_id']}, continued from {b['continues']}" in stdout["b"]
    assert f"megazero: run {c['run_id']} (a new run" in stdout["c"]
    by_start = _runs_by_start(records)
    assert [[r["iteration"] for r in part] for part in by_start] == [[stopped], [stopped + 1, stopped + 2], [1, 2]]
    assert all("loss" in r for part in by_start for r in part)  # readers that skip "event" records still work


def _panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def test_plot_draws_the_latest_run_or_each_run_apart(runs, capsys):
    tmp, metrics, records, stopped = runs.tmp, runs.metrics, runs.records, runs.stopped
    tool = load_tool("plot_metrics")
    assert tool.main([str(metrics), "--output", str(tmp / "latest.png")]) == 0
    assert "(1 run(s) against iteration); 1 earlier run(s) in the same file(s) left out" in capsys.readouterr().out
    assert tool.main([str(metrics), "--all-runs", "--output", str(tmp / "all.png")]) == 0
    assert "(2 run(s) against iteration)" in capsys.readouterr().out

    latest, _ = tool.load_runs(str(metrics), "logs")
    panels = _panels(tool.plot_runs(latest))
    (loss,) = panels["training loss"].get_lines()
    assert list(loss.get_xdata()) == [1, 2]
    assert len(panels["MoE balance"].get_lines()) == 1  # c is an MoE run

    every, left_out = tool.load_runs(str(metrics), "logs", all_runs=True)
    ids = [s["run_id"] for s in _starts(records)]
    assert left_out == 0 and [run.label for run in every] == [f"logs {ids[0]}", f"logs {ids[2]}"]
    fig = tool.plot_runs(every)
    panels = _panels(fig)
    ab, c = panels["training loss"].get_lines()
    assert list(ab.get_xdata()) == [stopped, stopped + 1, stopped + 2] and list(c.get_xdata()) == [1, 2]
    assert [line.get_label() for line in (ab, c)] == [run.label for run in every]
    assert len(panels["MoE balance"].get_lines()) == 1  # the dense run logged no balance
    legend = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert legend == [run.label for run in every]


GROUPS = {"loss": "train", "lr": "train", "grad_norm": "train", "consumed_samples": "train", "skipped": "train",
          "tokens_per_sec": "perf", "step_time_ms": "perf", "tflops_per_device": "perf", "elapsed_s": "perf",
          "eta_s": "perf", "bubble_fraction": "perf", "peak_memory_bytes": "memory",
          "val_loss": "val", "val_ppl": "val", "moe_imbalance": "moe", "moe_aux_loss": "moe",
          "moe_layers/0/imbalance": "moe"}


def test_tensorboard_groups_its_tags_and_holds_the_config(runs):
    tmp, records = runs.tmp, runs.records
    acc = event_accumulator.EventAccumulator(str(tmp / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    groups = {tag.split("/", 1)[1]: tag.split("/", 1)[0] for tag in tags}
    assert len(groups) == len(tags) and {field: groups.get(field) for field in GROUPS} == GROUPS
    assert set(groups.values()) == {"train", "val", "perf", "memory", "moe"}  # one rank: no bytes sent
    start = _starts(records)[2]
    (text,) = acc.Tensors("config/text_summary")
    shown = text.tensor_proto.string_val[0].decode()
    assert all(line.startswith("    ") for line in shown.splitlines())  # a Markdown code block
    config = yaml.safe_load("\n".join(line[4:] for line in shown.splitlines()))
    assert config == {"run_id": start["run_id"], "continues": None, "start_iteration": 0,
                      "layout": start["layout"], **start["config"]}


def test_outputs_line_names_the_timeline_and_the_wandb_run(runs):
    tmp, stdout = runs.tmp, runs.stdout
    where = next(line for line in stdout["c"].splitlines() if line.startswith("megazero: outputs:"))
    trace = tmp / "trace.rank0.json"
    assert trace.exists() and f"; timeline {trace} (Chrome trace" in where, where
    (folder,) = glob.glob(str(tmp / "wb" / "wandb" / "offline-run-*"))
    assert f"; wandb offline run {folder} (upload: .venv/bin/wandb sync {folder})" in where, where


def test_a_checkpoint_without_a_run_id_or_a_finetune_starts_a_new_run(tmp_path):
    folder = serial_ckpt.save(str(tmp_path / "ckpt"), 2)  # saved with no run id, as before ids existed
    cfg, pstate, _ = serial_ckpt.build()
    unrecorded = RunIdentity.agreed(cfg, folder, pstate)
    assert unrecorded.continues is None and re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", unrecorded.run_id)
    path = os.path.join(folder, storage.METADATA)
    meta = json.load(open(path))
    storage.write_json_atomic(path, {**meta, "run_id": "earlier"})
    assert RunIdentity.agreed(cfg, folder, pstate) == RunIdentity("earlier", folder)
    finetune = RunIdentity.agreed(cfg.updated(finetune=True), folder, pstate)
    assert finetune.run_id not in ("earlier", unrecorded.run_id) and finetune.continues is None


def test_first_eta_leaves_out_the_first_steps_start_up_cost():
    now = [0.0]
    progress = Progress(start_iteration=4, train_iters=104, clock=lambda: now[0])
    etas = []
    for iteration, seconds in zip(range(5, 9), [10.0, 1.0, 1.0, 1.0]):  # start-up in the first step
        now[0] += seconds
        etas.append(progress.fields(iteration)["eta_s"])
        progress.tick(iteration)
    assert etas[0] == 99 * 10.0  # only the first step is known yet
    assert etas[1:] == [98 * 1.0, 97 * 1.0, 96 * 1.0]
    assert progress.fields(8)["elapsed_s"] == 13.0


def test_log_timers_help_names_the_unit_the_log_prints():
    text = " ".join(build_parser().format_help().split())
    assert "--log-timers, --no-log-timers Also log how long this rank was blocked" in text
    assert "(the log line in ms, the metrics file's comm_wait_s in seconds)" in text
