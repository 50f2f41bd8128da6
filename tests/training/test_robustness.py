"""Run-time robustness through real pretrain_gpt.py ranks: unusable output paths, OS errors, signals, lost peers.

Each multi-rank test starts real gloo worlds (no mocked collective); subprocess
timeouts are hang guards only, never timing assertions.
"""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megazero.checkpoint import storage
from megazero.training.stop_signal import StopSignal
from megazero.parallel.state import free_port
from tests.helpers.launch import ROOT, launch

SMALL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "1"]
GUARD = 300  # seconds: a hang guard for the subprocesses, not a timing assertion


def _start(nproc: int, flags: list[str]) -> list[subprocess.Popen]:
    """nproc ranks of pretrain_gpt.py joining one gloo world, as torchrun would start them."""
    port, procs = str(free_port()), []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *SMALL, *flags],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _logged(metrics) -> list[int]:
    if not os.path.exists(metrics):
        return []
    return [r["iteration"] for r in map(json.loads, open(metrics).read().splitlines()) if "loss" in r]


def _wait_for(metrics, steps: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.time() + GUARD
    while len(_logged(metrics)) < steps:
        assert time.time() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
        time.sleep(0.2)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _one_line_error(stderr: str, *words: str) -> None:
    assert "Traceback" not in stderr, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), stderr[-2000:]


def test_unusable_save_path_fails_at_start_on_every_rank(tmp_path):
    """--save under a regular file: one line on every rank at start-up, before any training step."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    metrics = tmp_path / "m.jsonl"
    results = launch("pretrain_gpt.py", [*SMALL, "--tp", "2", "--train-iters", "3", "--save", str(blocker / "ckpt"),
                                         "--metrics-file", str(metrics)], 2, timeout=GUARD)
    for r in results:
        assert r.returncode == 2, r.stderr[-2000:]
        _one_line_error(r.stderr, "--save", str(blocker / "ckpt"), "Not a directory")
    assert _logged(metrics) == []  # failed before training, not after it


def test_probe_names_each_output_flag(tmp_path):
    """Every output flag is probed (metrics file, timeline, wandb dir); a missing folder is created."""
    from megazero.config import Config
    from megazero.training.preflight import check_output_paths

    blocker = tmp_path / "file"
    blocker.write_text("x")
    good = tmp_path / "new" / "folder"
    for flag, field in (("--metrics-file", "metrics_file"), ("--timeline", "timeline"), ("--wandb-dir", "wandb_dir"),
                        ("--save", "save")):
        cfg = Config.from_flat({"wandb_project": "p", field: str(blocker / "sub" / "out.json")})
        with pytest.raises(ValueError, match=flag) as err:
            check_output_paths(cfg)
        assert "Not a directory" in str(err.value) and "\n" not in str(err.value)
        ok = Config.from_flat({"wandb_project": "p", field: str(good / "out.json")})
        check_output_paths(ok)
        assert good.is_dir() and os.listdir(good) in ([], ["out.json"])  # probe file removed


def test_os_error_in_the_run_is_one_line(monkeypatch, capsys):
    """A disk-full OSError raised inside the run ends in one line naming the path and the OS reason."""
    import pretrain_gpt

    def disk_full(cfg):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/iter_0000002/model.safetensors")

    monkeypatch.setattr(pretrain_gpt, "run", disk_full)
    monkeypatch.delenv("MEGAZERO_DEBUG", raising=False)
    assert pretrain_gpt.main([*SMALL, "--train-iters", "1"]) == 1
    _one_line_error(capsys.readouterr().err, "/ckpt/iter_0000002/model.safetensors", "No space left on device")


def test_first_sigint_saves_and_exits_zero(tmp_path):
    """One SIGINT with --save: finish the step, save it, exit 0."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    procs = _start(1, ["--train-iters", "100000", "--save", str(ckpt), "--metrics-file", str(metrics)])
    try:
        _wait_for(metrics, 2, procs)
        procs[0].send_signal(signal.SIGINT)
        _, err = procs[0].communicate(timeout=GUARD)
    finally:
        _kill(procs)
    assert procs[0].returncode == 0, err[-2000:]
    assert "send it again to exit at once" in err
    assert (ckpt / "latest").read_text().strip() == storage.iteration_dir(_logged(metrics)[-1])


def test_a_sigterm_delivered_twice_at_once_still_saves(tmp_path):
    """torchrun forwards SIGTERM to workers that got it from their process group too (Slurm's cancel,
    ``timeout``): two deliveries milliseconds apart are one request, so the run saves and exits 0."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    procs = _start(1, ["--train-iters", "100000", "--save", str(ckpt), "--metrics-file", str(metrics)])
    try:
        _wait_for(metrics, 2, procs)
        procs[0].send_signal(signal.SIGTERM)
        time.sleep(0.1)  # apart enough to arrive as two signals (at once, the kernel merges them into one)
        procs[0].send_signal(signal.SIGTERM)
        _, err = procs[0].communicate(timeout=GUARD)
    finally:
        _kill(procs)
    assert procs[0].returncode == 0, err[-2000:]
    assert "exiting now without saving" not in err
    assert (ckpt / "latest").read_text().strip() == storage.iteration_dir(_logged(metrics)[-1])


def test_second_sigint_exits_at_once_while_stuck_in_a_collective(tmp_path):
    """Rank 1 is frozen (SIGSTOP) so rank 0 blocks in a collective; two SIGINTs still end rank 0.

    The previous checkpoint stays the published one, and nothing is published for the unfinished step.
    """
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    procs = _start(2, ["--tp", "2", "--train-iters", "100000", "--save", str(ckpt), "--save-interval", "1",
                       "--metrics-file", str(metrics)])
    try:
        _wait_for(metrics, 3, procs)
        procs[1].send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # rank 0 reaches the next collective with rank 1 and blocks there
        procs[0].send_signal(signal.SIGINT)
        time.sleep(3 * StopSignal.REPEAT_S)  # past the window in which a repeat counts as the same signal
        procs[0].send_signal(signal.SIGINT)
        _, err = procs[0].communicate(timeout=GUARD)  # a hang here is the bug: both signals swallowed
    finally:
        _kill(procs)
    assert procs[0].returncode != 0, err[-2000:]
    assert "send it again to exit at once" in err
    logged = _logged(metrics)
    published = storage.resolve(str(ckpt))
    meta = storage.read_metadata(published)  # the previous checkpoint is intact and loadable
    assert meta["iteration"] in logged
    finals = [d for d in os.listdir(ckpt) if re.fullmatch(r"iter_\d{7}", d)]  # staging folders may remain
    assert max(finals) <= storage.iteration_dir(max(logged)), (finals, logged)


def test_stuck_peer_ends_the_run_after_the_distributed_timeout(tmp_path):
    """A rank that stops answering ends its peer with one line after --distributed-timeout-minutes."""
    metrics = tmp_path / "m.jsonl"
    procs = _start(2, ["--tp", "2", "--train-iters", "100000", "--distributed-timeout-minutes", "0.1",
                       "--metrics-file", str(metrics)])
    try:
        _wait_for(metrics, 2, procs)
        procs[1].send_signal(signal.SIGSTOP)
        _, err = procs[0].communicate(timeout=GUARD)  # default timeout (10 min) would hit this guard
    finally:
        _kill(procs)
    assert procs[0].returncode == 1, err[-2000:]
    _one_line_error(err, "--distributed-timeout-minutes")


def test_torchrun_job_ends_when_a_rank_is_killed(tmp_path):
    """kill -9 one worker of a torchrun job with --save: the job exits non-zero (the SIGTERM handler
    must not hold up torchrun's teardown)."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "pretrain_gpt.py"), *SMALL, "--tp", "2", "--train-iters", "100000",
           "--distributed-timeout-minutes", "1", "--save", str(ckpt), "--metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    agent = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(metrics, 2, [agent])
        with open(f"/proc/{agent.pid}/task/{agent.pid}/children") as fh:
            workers = [int(pid) for pid in fh.read().split()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        _, err = agent.communicate(timeout=GUARD)
    finally:
        _kill([agent])
    assert agent.returncode != 0, err[-2000:]
