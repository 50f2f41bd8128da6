"""What a run says: start-up configuration (and config.yaml), data and wandb lines, checkpoint save/load lines,
the ETA in the log line, the end-of-run summary, and a user error's one line under torchrun.

Real pretrain_gpt.py ranks on gloo, shared by the checks: run "a" (2 ranks, ZeRO 1, saves at iterations 2
and 4, evaluates, logs to wandb offline) and run "b" (1 rank, resumes a's checkpoint with --async-save and
host-offloaded optimizer state); one torchrun launch with a bad flag; two hand-started ranks with
torchrun's error-file variables. The ETA arithmetic and the disk-offload line are checked in-process.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megazero.arguments import parse_config
from megazero.data import IndexedDataset, default_corpus
from megazero.data.gpt_dataset import split_documents
from megazero.run_plan import RunPlan
from megazero.training.progress import Progress, clock_time
from megazero.training.startup_report import HEADER, config_lines, offload_line, write_config
from tests.helpers.forked_ranks import run_forked
from tests.helpers.launch import ROOT, launch

SMALL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--recompute", "none"]
A_ARGS = [*SMALL, "--zero", "1", "--train-iters", "4", "--eval-interval", "2", "--save-interval", "2",
          "--wandb-project", "messages", "--wandb-mode", "offline"]
B_ARGS = [*SMALL, "--train-iters", "6", "--async-save", "--offload-optimizer", "cpu"]
GUARD = 300  # seconds: a hang guard for the subprocesses, not a timing assertion
BAD_TP = "pretrain_gpt.py: error: world size 2 is not divisible by --tp 3 x --pp 1 = 3; launch a multiple of 3 " \
         "processes or change --tp/--pp."


def _args_a(tmp) -> list[str]:
    return [*A_ARGS, "--save", str(tmp / "a" / "ckpt"), "--metrics-file", str(tmp / "a" / "logs" / "metrics.jsonl"),
            "--wandb-dir", str(tmp / "a")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run a, then run b resuming a's checkpoint (each rank must exit 0)."""
    tmp = tmp_path_factory.mktemp("messages")
    a = launch("pretrain_gpt.py", _args_a(tmp), 2, timeout=GUARD, default_corpus=True)
    for rank, r in enumerate(a):
        assert r.returncode == 0, f"run a rank {rank}:\n{r.stderr[-3000:]}"
    b = launch("pretrain_gpt.py", [*B_ARGS, "--load", str(tmp / "a" / "ckpt"), "--save", str(tmp / "b" / "ckpt"),
                                   "--metrics-file", str(tmp / "b" / "metrics.jsonl"),
                                   "--tensorboard-dir", str(tmp / "b" / "tb")], 1, timeout=GUARD, default_corpus=True)
    assert b[0].returncode == 0, b[0].stderr[-3000:]
    return tmp, a, b[0]


def _records(path) -> list[dict]:
    return [r for r in map(json.loads, open(path).read().splitlines()) if "iteration" in r]


def _folder_mib(folder: str) -> float:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names) / 2**20


def test_startup_prints_the_resolved_config_and_writes_config_yaml(runs):
    tmp, a, _ = runs
    resolved = parse_config(_args_a(tmp))[0].updated(vocab_size=8000)  # the default corpus's vocabulary
    written = [tmp / "a" / "ckpt" / "config.yaml", tmp / "a" / "logs" / "config.yaml"]
    assert written[0].read_text() == written[1].read_text() and written[0].read_text().startswith(HEADER)
    loaded = parse_config(["--config", str(written[0])])[0]
    assert loaded == resolved  # --config reproduces the run's Config
    shown = [line for line in a[0].stdout.splitlines() if line.startswith("megazero: config ")]
    assert shown == config_lines(resolved) and len(shown) == 7  # one line per section, every setting
    assert "zero=1" in shown[0] and "vocab_size=8000" in shown[1] and "train_iters=4" in shown[4]
    assert f"megazero: wrote {written[0]}" in a[0].stdout.splitlines()
    assert "megazero: config" not in a[1].stdout  # rank 0 only


def test_startup_data_line_counts_documents_tokens_samples_epochs(runs):
    tmp, a, _ = runs
    corpus = default_corpus(log=lambda *_: None)
    indexed = IndexedDataset(corpus.data_prefix)
    lengths = indexed.doc_lengths.astype(np.int64)
    train_docs, valid_docs, _ = split_documents(len(indexed), "969,30,1")
    parts = []
    for name, docs, samples in (("training", train_docs, 4 * 4), ("validation", valid_docs, 2 * 4)):
        tokens = int(lengths[docs].sum())
        epochs = math.ceil((samples * 16 + 1) / tokens)
        parts.append(f"{name} {len(docs)} documents, {tokens} tokens -> {samples} samples, {epochs} epoch"
                     + ("s" if epochs > 1 else ""))
    expected = (f"megazero: data the default corpus {corpus.data_prefix}: weight 1.000, {len(indexed)} documents, "
                f"{int(lengths.sum())} tokens; " + "; ".join(parts))
    assert expected in a[0].stdout.splitlines()


def test_wandb_line_names_the_offline_run_and_how_to_sync_it(runs):
    tmp, a, _ = runs
    line = next(line for line in a[0].stdout.splitlines() if line.startswith("megazero: wandb:"))
    folder = re.fullmatch(r"megazero: wandb: offline run in (\S+); upload it with: \.venv/bin/wandb sync (\S+)", line)
    assert folder and folder[1] == folder[2] and folder[1].startswith(str(tmp / "a" / "wandb" / "offline-run-"))
    assert any(name.endswith(".wandb") for name in os.listdir(folder[1]))


SAVED = re.compile(r"megazero: saved checkpoint (\S+) \(([\d.]+) MiB\) in ([\d.]+) s")
PUBLISHED = re.compile(r"megazero: --async-save published checkpoint (\S+) \(([\d.]+) MiB\) ([\d.]+) s after it "
                       r"started; training paused ([\d.]+) s for its snapshot")
LOADED = re.compile(r"megazero: loaded checkpoint (\S+) \(([\d.]+) MiB on disk\) in ([\d.]+) s")


def test_each_save_and_load_says_path_size_and_seconds(runs):
    tmp, a, b = runs
    saved = [SAVED.fullmatch(line) for line in a[0].stdout.splitlines() if SAVED.fullmatch(line)]
    assert [m[1] for m in saved] == [str(tmp / "a" / "ckpt" / f"iter_000000{i}") for i in (2, 4)]
    for m in saved:
        assert abs(float(m[2]) - _folder_mib(m[1])) <= 0.05 and float(m[3]) >= 0
    assert "saved checkpoint" not in a[1].stdout  # rank 0 only
    loaded = [LOADED.fullmatch(line) for line in b.stdout.splitlines() if LOADED.fullmatch(line)]
    assert len(loaded) == 1 and loaded[0][1] == saved[-1][1] and loaded[0][2] == saved[-1][2]
    published = [PUBLISHED.fullmatch(line) for line in b.stdout.splitlines() if PUBLISHED.fullmatch(line)]
    assert [m[1] for m in published] == [str(tmp / "b" / "ckpt" / "iter_0000006")]
    assert abs(float(published[0][2]) - _folder_mib(published[0][1])) <= 0.05
    assert float(published[0][4]) <= float(published[0][3])


def test_offload_lines(runs, tmp_path):
    _, _, b = runs
    assert ("megazero: offload: optimizer state (fp32 master weights, Adam moments) in host memory (pinned on CUDA)"
            in b.stdout.splitlines())
    cfg, _ = parse_config([*SMALL, "--zero", "3", "--offload-optimizer", "disk", "--offload-params", "cpu",
                           "--offload-path", str(tmp_path)])
    assert offload_line(RunPlan.resolve(cfg, 2), 2) == (
        f"megazero: offload: optimizer state (fp32 master weights, Adam moments) in per-rank files under "
        f"{tmp_path}/rank0 .. rank1 (removed when the run ends); parameter shards in host memory (pinned on CUDA)")
    assert offload_line(RunPlan.resolve(parse_config(SMALL)[0], 1), 1) is None


def test_log_line_has_elapsed_and_eta(runs):
    tmp, a, _ = runs
    records = [r for r in _records(tmp / "a" / "logs" / "metrics.jsonl") if "event" not in r]
    lines = [line for line in a[0].stdout.splitlines() if line.startswith("iteration ")]
    assert len(lines) == len(records) == 4
    for line, r in zip(lines, records):
        assert f"| elapsed {clock_time(r['elapsed_s'])} | ETA {clock_time(r['eta_s'])} |" in line
    assert [r["elapsed_s"] for r in records] == sorted(r["elapsed_s"] for r in records)
    assert records[-1]["eta_s"] == 0 and all(r["eta_s"] > 0 for r in records[:-1])


def test_eta_is_remaining_iterations_times_the_recent_mean():
    now = [100.0]
    progress = Progress(start_iteration=10, train_iters=50, clock=lambda: now[0])
    for iteration, seconds in zip(range(11, 41), [9.0] + [2.0] * 29):  # a slow first step, then 2 s each
        now[0] += seconds
        fields = progress.fields(iteration)
        progress.tick(iteration)
    assert fields["elapsed_s"] == 9 + 2 * 29
    assert fields["eta_s"] == pytest.approx(10 * 2.0)  # the window of the last 20 forgot the slow step
    assert clock_time(3725.4) == "1:02:05"


def _summary(stdout: str) -> re.Match:
    line = next(line for line in stdout.splitlines() if line.startswith("megazero: done:"))
    found = re.fullmatch(r"megazero: done: (\d+) iterations \(now at (\d+)/(\d+)\), (\d+) tokens in \S+ "
                         r"\(([\d.]+) s\), (\d+) tokens/s; final lm loss (\S+)(?:, validation loss (\S+) "
                         r"\(iteration (\d+)\))?", line)
    assert found, line
    return found


def test_end_summary_equals_the_metrics_file(runs):
    tmp, a, b = runs
    for stdout, metrics, start, consumed in ((a[0].stdout, tmp / "a" / "logs" / "metrics.jsonl", 0, 0),
                                             (b.stdout, tmp / "b" / "metrics.jsonl", 4, 16)):
        records = _records(metrics)
        trained = [r for r in records if "event" not in r]
        evals = [r for r in records if r.get("event") == "eval"]
        s = _summary(stdout)
        tokens = (trained[-1]["consumed_samples"] - consumed) * 16
        assert (int(s[1]), int(s[2]), int(s[3]), int(s[4])) == (trained[-1]["iteration"] - start,
                                                                trained[-1]["iteration"], 6 if start else 4, tokens)
        assert float(s[5]) >= round(trained[-1]["elapsed_s"], 1)  # the loop's wall time, up to its last save
        shortest, longest = float(s[5]) - 0.05, float(s[5]) + 0.05  # the printed seconds are rounded to 0.1 s,
        assert tokens / longest - 0.5 <= int(s[6])  # the rate to 1 token/s (a run under 0.05 s prints 0.0 s)
        assert shortest <= 0 or int(s[6]) <= tokens / shortest + 0.5
        assert s[7] == f"{trained[-1]['loss']:.6E}"
        assert (s[8], s[9]) == ((f"{evals[-1]['val_loss']:.6E}", str(evals[-1]["iteration"])) if evals else
                                (None, None))
    where = next(line for line in a[0].stdout.splitlines() if line.startswith("megazero: outputs:"))
    metrics = tmp / "a" / "logs" / "metrics.jsonl"
    assert (f"metrics {metrics} (plot: .venv/bin/python tools/plot_metrics.py {metrics} --output "
            f"{tmp / 'a' / 'logs' / 'metrics.png'})") in where
    assert f"checkpoints {tmp / 'a' / 'ckpt'} ('latest' in {tmp / 'a' / 'ckpt'} names iter_0000004)" in where
    assert "megazero: done:" not in a[1].stdout
    where = next(line for line in b.stdout.splitlines() if line.startswith("megazero: outputs:"))
    assert f"; tensorboard {tmp / 'b' / 'tb'} (.venv/bin/tensorboard --logdir {tmp / 'b' / 'tb'})" in where


def test_config_yaml_leaves_user_files_alone(tmp_path):
    cfg, _ = parse_config(["--config", "configs/tiny.yaml", "--fp16"])
    (tmp_path / "config.yaml").write_text("mine: true\n")
    assert write_config(cfg, str(tmp_path)) is None and (tmp_path / "config.yaml").read_text() == "mine: true\n"
    other = tmp_path / "run"
    path = write_config(cfg, str(other))
    assert parse_config(["--config", path])[0] == cfg  # settings that cannot apply (none with --fp16) left out
    assert write_config(cfg.updated(lr=0.5), str(other)) == path and "lr: 0.5" in open(path).read()


def test_torchrun_prints_a_user_error_once_and_names_it_as_root_cause():
    """Two ranks fail alike; torchrun's own summary (its last lines) names the one line as the root cause."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "pretrain_gpt.py", *SMALL, "--tp", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=GUARD, env={**os.environ, "OMP_NUM_THREADS": "1"})
    combined = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0
    assert combined.count(BAD_TP) == 1, "\n".join(combined[-40:])
    root_cause = combined[combined.index("Root Cause (first observed failure):"):]
    assert f"  traceback : {BAD_TP}" in root_cause[-8:]
    assert 'pretrain_gpt.py", line' not in proc.stderr  # no traceback of the ranks (torchrun prints its own)


def test_every_rank_exits_2_and_records_the_line_printed_once(tmp_path):
    """The ranks as torchrun starts them (an error file each in one attempt folder): all exit 2, one prints."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "PYTHONPATH": ROOT,
           "OMP_NUM_THREADS": "1"}
    files = [tmp_path / "attempt_0" / str(rank) / "error.json" for rank in range(2)]
    for error_file in files:
        error_file.parent.mkdir(parents=True)
    ranks = run_forked(os.path.join(ROOT, "pretrain_gpt.py"),
                       [{**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "TORCHELASTIC_ERROR_FILE": str(error_file)}
                        for rank, error_file in enumerate(files)], [*SMALL, "--tp", "3"], ROOT, GUARD)
    assert [code for code, _, _ in ranks] == [2, 2]
    printed = [line for _, _, err in ranks for line in err.splitlines()]
    assert printed == [BAD_TP]  # once, and no traceback
    for error_file in files:
        assert json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"] == BAD_TP
