"""Every orderly stop concludes a pending --async-save, every message about 'latest' states what is on disk,
and a --load already at --train-iters says there is nothing to do.

Real pretrain_gpt.py ranks on gloo: a 2-rank ZeRO 1 run whose async save of iteration 1 is still pending
when it stops for --max-skipped-steps at iteration 2 (lr 1e8: the first update makes every later forward
NaN; the stop comes in the very next step, before any poll could have published the save); the same run
with a real write limit on rank 1 (the pending save fails); a run that loads the published checkpoint; a
--load at --train-iters; a SIGTERM with --async-save. The messages of a save that publishes nothing are
checked in-process on the serial test model.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from megazero.checkpoint import storage
from megazero.checkpoint.save import CheckpointContext, save_checkpoint
from megazero.run_plan import RunPlan
from tests.helpers.async_ckpt import saver_for
from megazero.parallel.state import free_port
from tests.helpers.launch import ROOT, launch
from tests.helpers.serial_ckpt import build, save
from tests.helpers.signals import signal_when

SMALL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--zero", "1"]
DIVERGE = ["--lr", "1e8", "--lr-warmup-iters", "0", "--train-iters", "30", "--max-skipped-steps", "1",
           "--async-save", "--save-interval", "1"]
GUARD = 300  # seconds: a hang guard for the subprocesses, not a timing assertion


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]


def _iterations(metrics) -> list[tuple[int, int]]:
    records = [json.loads(line) for line in open(metrics).read().splitlines()]
    return [(r["iteration"], r["consumed_samples"]) for r in records if "event" not in r]


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """The --save folder of a run that stopped for --max-skipped-steps with a save pending, and its ranks."""
    tmp = tmp_path_factory.mktemp("diverged")
    root = str(tmp / "ckpt")
    results = launch("pretrain_gpt.py", [*SMALL, *DIVERGE, "--save", root, "--metrics-file", str(tmp / "m.jsonl")],
                     2, timeout=GUARD)
    return tmp, root, results


def test_divergence_stop_publishes_the_pending_async_save(diverged):
    tmp, root, results = diverged
    assert _iterations(tmp / "m.jsonl") == [(1, 4), (2, 8)]  # the stop came in the step after the save
    assert sorted(os.listdir(root)) == ["config.yaml", "iter_0000001", "latest"], "published, no staging folder left"
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000001"
    assert storage.read_metadata(storage.resolve(root))["iteration"] == 1
    for rank, r in enumerate(results):  # every rank: status 2, one line, and what it says of 'latest' is true
        errors = _errors(r.stderr)
        assert r.returncode == 2 and len(errors) == 1, f"rank {rank}:\n{r.stderr[-3000:]}"
        assert "stopped at iteration 2" in errors[0] and "--max-skipped-steps" in errors[0], errors[0]
        assert errors[0].endswith(f"'latest' in {root} names iter_0000001."), errors[0]
        assert "not published" not in r.stdout + r.stderr


FULL_DISK_ON_RANK_1 = """
import os, resource, signal, sys
from tests.helpers.script_exit import run_then_exit

if os.environ["RANK"] == "1":  # a real write limit: this rank's optimizer shard cannot be written
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
import pretrain_gpt
run_then_exit(lambda: pretrain_gpt.main(sys.argv[1:]))
"""


def test_divergence_stop_says_truly_that_the_pending_save_failed(tmp_path):
    """The pending save's write failed on rank 1: the stop concludes it on every rank (nothing published,
    the staging folder removed), says so in one line, and the stop's own error claims no checkpoint."""
    script, root = tmp_path / "full_disk.py", str(tmp_path / "ckpt")
    script.write_text(FULL_DISK_ON_RANK_1)
    # forked ranks (the limit is per process, as under Popen); rank 1's stdout/stderr files are far below it
    results = launch(str(script), [*SMALL, *DIVERGE, "--save", root], 2, timeout=GUARD)
    assert os.listdir(root) == ["config.yaml"]  # the run's resolved configuration; no checkpoint, no staging
    for rank, r in enumerate(results):
        errors = _errors(r.stderr)
        assert r.returncode == 2 and len(errors) == 1, f"rank {rank}:\n{r.stderr[-3000:]}"
        assert "stopped at iteration 2" in errors[0], errors[0]
        assert errors[0].endswith(f"{root} holds no published checkpoint yet (no 'latest')."), errors[0]
    stopping = [line for line in results[0].stdout.splitlines() if line.startswith("megazero: stopping:")]
    assert len(stopping) == 1 and "optim_tp00_pp00_dp01.safetensors" in stopping[0], results[0].stdout[-3000:]
    assert (f"checkpoint of iteration 1 not saved, {root} holds no published checkpoint yet (no 'latest')"
            in stopping[0]), stopping[0]


def test_checkpoint_published_at_the_stop_loads_and_resumes(diverged):
    tmp, root, _ = diverged
    metrics = tmp / "resumed.jsonl"
    results = launch("pretrain_gpt.py", [*SMALL, "--lr", "1e-3", "--train-iters", "2", "--max-skipped-steps", "0",
                                         "--load", root, "--metrics-file", str(metrics)], 1, timeout=GUARD)
    assert results[0].returncode == 0, results[0].stderr[-3000:]  # one rank: the dp 2 shards resharded on load
    assert f"loading checkpoint {root}/iter_0000001 (iteration 1)" in results[0].stdout
    assert _iterations(metrics) == [(2, 8)]  # resumed after iteration 1, its 4 samples consumed


def test_load_at_train_iters_says_nothing_to_do(diverged):
    """Exit 0 with one line (rank 0), before any process group: nothing trained, nothing saved over."""
    tmp, root, _ = diverged
    before = {name: os.stat(os.path.join(root, name)).st_mtime_ns for name in os.listdir(root)}
    metrics = tmp / "idle.jsonl"
    results = launch("pretrain_gpt.py", [*SMALL, "--lr", "1e-3", "--train-iters", "1", "--load", root,
                                         "--save", root, "--metrics-file", str(metrics)], 2, timeout=GUARD)
    for rank, r in enumerate(results):
        assert r.returncode == 0 and not r.stderr.strip(), f"rank {rank}:\n{r.stderr[-3000:]}"
    assert results[0].stdout.splitlines() == [
        f"megazero: nothing to do: the checkpoint at iteration 1 ({root}/iter_0000001) is already at "
        f"--train-iters 1; raise --train-iters to train further"]
    assert results[1].stdout == ""
    assert not metrics.exists()
    assert {name: os.stat(os.path.join(root, name)).st_mtime_ns for name in os.listdir(root)} == before


def test_sigterm_with_async_save_publishes_and_says_where(tmp_path):
    """A signal's save under --async-save is published before the exit, and the last line names it."""
    root, metrics = str(tmp_path / "ckpt"), tmp_path / "m.jsonl"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *SMALL, "--lr", "1e-3",
                             "--train-iters", "100000", "--async-save", "--save-interval", "1", "--save", root,
                             "--metrics-file", str(metrics)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = signal_when(proc, lambda: metrics.exists() and len(_iterations(metrics)) >= 3, signal.SIGTERM, GUARD)
    assert proc.returncode == 0, err[-3000:]
    last = _iterations(metrics)[-1][0]
    assert out.splitlines()[-1] == (f"megazero: stopped by signal after iteration {last}; checkpoint saved, "
                                    f"'latest' in {root} names {storage.iteration_dir(last)}")
    assert open(os.path.join(root, "latest")).read().strip() == storage.iteration_dir(last)
    assert not [n for n in os.listdir(root) if ".tmp-" in n]


def test_unpublished_async_save_says_what_latest_names(tmp_path):
    """An error exit (``close``) publishes nothing and says so, naming what 'latest' really names, if anything."""
    from megazero.parallel.state import ParallelState

    root, said = str(tmp_path / "ckpt"), []
    saver = saver_for(root, ParallelState.serial(), log=said.append)
    saver.save(3, 0)
    saver.close()
    saver.save(5, 0)
    saver.finish()
    saver.save(9, 0)
    saver.close()
    assert (f"{root} holds no published checkpoint yet (no 'latest'); the next save removes "
            f"{root}/iter_0000003.tmp-") in said[0], said
    assert said[1].startswith(f"megazero: --async-save published checkpoint {root}/iter_0000005 ("), said
    assert "iteration 3 was not published" in said[0] and "iteration 9 was not published" in said[2]
    assert f"'latest' in {root} names iter_0000005;" in said[2], said
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000005"


def test_refused_save_without_a_checkpoint_says_there_is_none(tmp_path):
    """A NaN refused on the first save: no 'latest' exists, and the message does not claim one."""
    root = str(tmp_path / "ckpt")
    cfg, pstate, model = build()
    with torch.no_grad():
        next(model.chunks[0].parameters())[0] = float("nan")
    plan = RunPlan.resolve(cfg, 1)
    ctx = CheckpointContext(root, cfg, plan, pstate, model)
    with pytest.raises(ValueError) as err:
        save_checkpoint(ctx, 2, 0)
    assert f"{root} holds no published checkpoint yet (no 'latest'); start again" in str(err.value), err.value
    save(root, 1)
    with pytest.raises(ValueError) as err:
        save_checkpoint(ctx, 2, 0)
    assert f"'latest' in {root} names iter_0000001; resume from it" in str(err.value), err.value
