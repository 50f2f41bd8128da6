"""Two jobs, one folder: --save and --offload-path belong to one job at a time (training/ownership.py).

Real pretrain_gpt.py processes: job A holds its folders (held at start-up by a metrics file that
is a FIFO, so it is certainly still running), two 2-rank jobs B given A's --offload-path or --save stop at start-up on
every rank with one line naming the folder and A; A then finishes with the losses of a solo run. The
solo run starts on folders whose lock files a SIGKILLed holder left (a stale lock must not block a
restart), and its checkpoint, with a truncated optimizer shard, is the start-up failure after
which no offload file may remain. Subprocess timeouts are hang guards only.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from megazero.parallel.state import free_port
from tests.helpers.launch import ROOT, launch

LOCK = ".megazero.lock"  # ownership.LOCK_NAME (checked below); spelled out so the old code's runs can use it
SMALL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--zero", "1", "--train-iters", "6"]
GUARD = 300  # seconds: a hang guard, not a timing assertion
HOLDER = """
import fcntl, json, os, sys, time
for folder in sys.argv[1:]:
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, {lock!r}), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({{"host": "gone", "pid": os.getpid(), "SLURM_JOB_ID": "1111"}}).encode())
print("held", flush=True)
time.sleep(600)
""".format(lock=LOCK)


def _losses_of(text: str) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in text.splitlines()]
    return [(r["iteration"], r["loss"]) for r in records if "loss" in r]


def _losses(metrics: str) -> list[tuple[int, float]]:
    return _losses_of(open(metrics).read())


def _one_line_error(stderr: str, *words: str) -> None:
    assert "Traceback" not in stderr, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), stderr[-2000:]


def _kill_holding(folders: list[str]) -> None:
    """A process that takes the locks of ``folders`` and dies by SIGKILL, leaving its lock files behind."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, *folders], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture(scope="module")
def solo(tmp_path_factory) -> dict:
    """One process, disk offload, --save; its folders hold the lock files of a SIGKILLed holder."""
    tmp = tmp_path_factory.mktemp("solo")
    save, offload, metrics = str(tmp / "save"), str(tmp / "offload"), str(tmp / "metrics.jsonl")
    _kill_holding([save, os.path.join(offload, "rank0")])
    stale = [os.path.exists(os.path.join(d, LOCK)) for d in (save, os.path.join(offload, "rank0"))]
    [result] = launch("pretrain_gpt.py", [*SMALL, "--offload-optimizer", "disk", "--offload-path", offload,
                                          "--save", save, "--metrics-file", metrics], nproc=1, timeout=GUARD,
                      default_corpus=True)
    return {"result": result, "stale": stale, "save": save, "offload": offload, "metrics": metrics}


def test_lock_file_of_a_killed_job_does_not_block_a_restart(solo):
    assert solo["stale"] == [True, True]  # the killed holder's lock files were there when the run started
    assert solo["result"].returncode == 0, solo["result"].stderr[-2000:]
    assert len(_losses(solo["metrics"])) == 6
    assert not os.path.exists(os.path.join(solo["save"], LOCK))  # the run's own lock file goes when it ends
    assert os.listdir(solo["offload"]) == []  # its rank0/ folder, the state file and the lock file with it


def _read_fifo_until_exit(fifo: str, proc: subprocess.Popen) -> str:
    """Everything ``proc`` writes into ``fifo`` (it blocks opening it until this reader is there)."""
    fd, chunks, deadline = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK), [], time.time() + GUARD
    try:
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:  # the writer is there, with nothing new yet
                chunk = None
            if chunk:
                chunks.append(chunk)
            elif proc.poll() is not None:  # no writer now, and none to come
                return b"".join(chunks).decode()
            else:
                assert time.time() < deadline, "hang guard"
                time.sleep(0.05)
    finally:
        os.close(fd)


def test_a_second_job_on_a_held_folder_stops_on_every_rank(tmp_path, solo):
    """Job A's metrics file is a FIFO: A blocks opening it, past start-up (its folders held, its state file
    written), until the test reads it, so A is certainly still running while the two B jobs start."""
    save, offload, metrics = str(tmp_path / "save"), str(tmp_path / "offload"), str(tmp_path / "a.jsonl")
    os.mkfifo(metrics)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "SLURM_JOB_ID": "4242"}
    job_a = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *SMALL, "--offload-optimizer",
                              "disk", "--offload-path", offload, "--save", save, "--metrics-file", metrics],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + GUARD
        while not os.path.exists(os.path.join(offload, "rank0", "optimizer_state.bin")):
            assert job_a.poll() is None and time.time() < deadline, job_a.communicate()[1][-2000:]
            time.sleep(0.05)
        on_offload = launch("pretrain_gpt.py", [*SMALL, "--offload-optimizer", "disk", "--offload-path", offload],
                            nproc=2, timeout=GUARD, default_corpus=True)
        on_save = launch("pretrain_gpt.py", [*SMALL, "--save", save], nproc=2, timeout=GUARD, default_corpus=True)
        written = _read_fifo_until_exit(metrics, job_a)
        out, err = job_a.communicate(timeout=GUARD)
    finally:
        if job_a.poll() is None:
            job_a.kill()
            job_a.wait()
    holder = ["Slurm job 4242", f"pid {job_a.pid}"]
    for rank in on_offload:  # rank 1's own folder (offload/rank1) is free: it stops on rank 0's verdict
        assert rank.returncode == 2, rank.stderr[-2000:]
        _one_line_error(rank.stderr, f"--offload-path {offload} is in use by", *holder, "another --offload-path")
    for rank in on_save:
        assert rank.returncode == 2, rank.stderr[-2000:]
        _one_line_error(rank.stderr, f"--save {save} is in use by", *holder, "another --save")
    assert job_a.returncode == 0, err[-2000:]
    assert _losses_of(written) == _losses(solo["metrics"])  # A's state file was not touched
    assert os.listdir(offload) == [] and not os.path.exists(os.path.join(save, LOCK))


def test_startup_failure_after_the_optimizer_is_built_leaves_no_offload_files(tmp_path, solo):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(solo["save"], ckpt)
    [shard] = glob.glob(os.path.join(ckpt, "iter_*", "optim_*.safetensors"))
    with open(shard, "r+b") as fh:  # a corrupt shard: the load fails after the disk store wrote its file
        fh.truncate(os.path.getsize(shard) // 2)
    offload = str(tmp_path / "offload")
    [result] = launch("pretrain_gpt.py", [*SMALL, "--train-iters", "8", "--load", ckpt, "--offload-optimizer",
                                          "disk", "--offload-path", offload], nproc=1, timeout=GUARD,
                      default_corpus=True)
    assert result.returncode != 0 and os.path.basename(shard) in result.stderr, result.stderr[-2000:]
    assert glob.glob(os.path.join(offload, "rank*", "*")) == []
    assert glob.glob(os.path.join(offload, "rank*", ".*")) == []


def test_lock_notes_and_takeover(tmp_path, monkeypatch):
    from megazero.training import ownership
    from megazero.training.ownership import FolderLock, describe

    assert ownership.LOCK_NAME == LOCK
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    folder = str(tmp_path / "f")
    os.makedirs(folder)
    with open(os.path.join(folder, LOCK), "w") as fh:
        fh.write("not json")  # a dead holder's leftover, unreadable: taken over all the same
    lock = FolderLock.take(folder)
    assert isinstance(lock, FolderLock)
    held = FolderLock.take(folder)  # another open file: flock refuses it even in this process
    assert isinstance(held, dict) and held["pid"] == os.getpid() and held["SLURM_JOB_ID"] == "99"
    assert describe(held).startswith("Slurm job 99 (host ") and f"pid {os.getpid()}" in describe(held)
    lock.release()
    assert os.listdir(folder) == []
    again = FolderLock.take(folder)
    assert isinstance(again, FolderLock)
    again.release()
