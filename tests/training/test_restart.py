"""Restarts: the --load == --save idiom, a worker killed under torchrun, the Slurm launcher, the timeout.

The kill-and-resume test runs one command line twice on 2 ranks (dp 2, zero 1): once through
tools/launch_slurm.sh with a fake one-node Slurm environment, uninterrupted (the reference), and
once under ``torchrun --standalone --max-restarts 1``, where the test SIGKILLs rank 1 as soon as
a checkpoint at iteration >= 4 is published. torchrun restarts both workers; they resume from
``latest``. The metrics file is appended to by every start, so the interrupted run's file holds
iterations 1..m and then K+1..N again (K = the checkpoint it resumed from); the test compares the
last record of each iteration with the reference, bitwise (exact resume on CPU, as in
tests/checkpoint/test_resume.py). Subprocess timeouts are hang guards, never timing assertions.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from megazero.checkpoint import storage
from megazero.config import Config
from megazero.training.run import find_checkpoint, validate
from tests.helpers.launch import ROOT, _free_port, launch

GUARD = 300  # seconds: a hang guard for the subprocesses, not a timing assertion
ITERS = 30  # long enough that the kill (at a checkpoint >= 4) lands well before the end
TRAIN = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "2", "--zero", "1", "--train-iters", str(ITERS), "--save-interval", "2"]
FRESH = "holds no checkpoint yet; starting from scratch"
LOADING = re.compile(r"megazero: loading checkpoint \S+ \(iteration (\d+)\)")


# -- (a) the restart idiom: which --load starts fresh ------------------------------------------------
def _cfg(load, save) -> Config:
    return Config.from_flat({"load": str(load), "save": None if save is None else str(save)})


def test_restart_idiom_starts_fresh_only_in_the_save_folder(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert find_checkpoint(_cfg(ckpt, ckpt)) is None  # not created yet
    (ckpt / "iter_0000002.tmp-1").mkdir(parents=True)  # a save that never finished is no checkpoint
    assert find_checkpoint(_cfg(ckpt, ckpt)) is None
    assert find_checkpoint(_cfg(f"{ckpt}/", tmp_path / "." / "ckpt")) is None  # compared as resolved paths
    (tmp_path / "link").symlink_to(ckpt)
    assert find_checkpoint(_cfg(tmp_path / "link", ckpt)) is None
    for save in (tmp_path / "elsewhere", None):  # --load elsewhere (a typo) or without --save: still an error
        with pytest.raises(ValueError, match=r"--load .* holds no checkpoint"):
            find_checkpoint(_cfg(ckpt, save))
    (ckpt / storage.LATEST).write_text("iter_0000002\n")  # latest names an incomplete folder: an error, not fresh
    with pytest.raises(ValueError, match="incomplete"):
        find_checkpoint(_cfg(ckpt, ckpt))
    (ckpt / "iter_0000002").mkdir()
    (ckpt / "iter_0000002" / storage.METADATA).write_text(json.dumps(
        {"format": storage.FORMAT, "version": storage.VERSION, "iteration": 2}))
    folder, meta = find_checkpoint(_cfg(ckpt, ckpt))
    assert folder == str(ckpt / "iter_0000002") and meta["iteration"] == 2


# -- the Slurm launcher --------------------------------------------------------------------------------
def _fake_slurm(tmp_path, hosts: str, node_id: int, **extra: str) -> dict[str, str]:
    """Slurm's environment for one node, with a stand-in `scontrol show hostnames` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames $SLURM_JOB_NODELIST" ] && '
                        'printf "%s\\n" $FAKE_SLURM_HOSTS\n')
    scontrol.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[07-08]",
            "FAKE_SLURM_HOSTS": hosts, "SLURM_NNODES": str(len(hosts.split())), "SLURM_NODEID": str(node_id),
            "SLURM_JOB_ID": "4242", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **extra}


def _dry_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.path.join(ROOT, "tools/launch_slurm.sh"), "--dry-run", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_slurm_launcher_derives_the_torchrun_command(tmp_path):
    """The printed command, read back by torchrun's own argument parser."""
    from torch.distributed.run import get_args_parser

    train = ["--config", "configs/my run.yaml", "--tp", "8", "--save", "d", "--load", "d"]
    for node_id, extra, flags, nproc in ((1, {"SLURM_GPUS_ON_NODE": "8"}, [], "8"),
                                         (0, {"SLURM_NTASKS_PER_NODE": "4"}, ["--port", "1234"], "4"),
                                         (0, {"SLURM_GPUS_ON_NODE": "8"}, ["--nproc-per-node", "2"], "2")):
        out = _dry_run(_fake_slurm(tmp_path, "gpu07 gpu08", node_id, **extra), *flags, "--max-restarts", "5",
                       "--", *train)
        assert out.returncode == 0, out.stderr
        cmd = shlex.split(out.stdout)
        assert cmd[:5] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable, "-m", "torch.distributed.run"]
        got = get_args_parser().parse_args(cmd[5:])
        assert (got.nnodes, got.nproc_per_node, got.max_restarts) == ("2", nproc, 5)
        assert (got.rdzv_backend, got.rdzv_id) == ("c10d", "4242")
        assert got.rdzv_endpoint == f"gpu07:{flags[1] if flags[:1] == ['--port'] else 29500}"
        assert got.rdzv_conf == f"is_host={'true' if node_id == 0 else 'false'}"  # node 0 hosts the store
        assert got.training_script == os.path.join(ROOT, "pretrain_gpt.py") and got.training_script_args == train
    bare = _fake_slurm(tmp_path, "gpu07 gpu08", 0)
    out = _dry_run(bare)
    assert out.returncode == 2 and "pass --nproc-per-node N" in out.stderr
    out = _dry_run({k: v for k, v in bare.items() if k != "SLURM_JOB_ID"}, "--nproc-per-node", "2")
    assert out.returncode == 2 and "$SLURM_JOB_ID is not set" in out.stderr


def test_sbatch_example_passes_valid_flags(tmp_path):
    """The example sbatch file, with srun faked to add --dry-run: its pretrain_gpt.py flags parse."""
    from megazero.arguments import parse_config

    env = _fake_slurm(tmp_path, "gpu07 gpu08", 0, SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=ROOT)
    srun = tmp_path / "bin" / "srun"  # drops srun's own options, runs the launcher in print mode
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$1" --dry-run "${@:2}"\n')
    srun.chmod(0o755)
    out = subprocess.run(["bash", os.path.join(ROOT, "examples/slurm/pretrain_gpt.sbatch")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout)
    args = cmd[cmd.index(os.path.join(ROOT, "pretrain_gpt.py")) + 1:]
    cfg, _ = parse_config(args)
    validate(cfg, 2 * 8, 8)  # the layout fits the 2 nodes x 8 GPUs the file asks for, tp inside a node
    assert cfg.checkpoint.load == cfg.checkpoint.save and "--max-restarts" in cmd  # the restart idiom


# -- (b) kill a worker mid-run; torchrun restarts the job and it resumes ------------------------------------
def _workers(agent_pid: int) -> dict[int, int]:
    """{RANK: pid} of the pretrain_gpt.py workers the torchrun agent started (read from /proc)."""
    found = {}
    for children in glob.glob(f"/proc/{agent_pid}/task/*/children"):
        for pid in open(children).read().split():
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:  # gone already
                continue
            rank = [int(kv[5:]) for kv in environ if kv.startswith(b"RANK=")]
            if b"pretrain_gpt.py" in cmdline and rank:
                found[rank[0]] = int(pid)
    return found


def _published(ckpt) -> int:
    try:
        return int((ckpt / storage.LATEST).read_text().strip().removeprefix("iter_"))
    except (OSError, ValueError):
        return 0


def _kill_rank_after_checkpoint(agent: subprocess.Popen, ckpt, rank: int, at_least: int) -> int | None:
    """SIGKILL ``rank`` once a checkpoint at iteration >= at_least is published; its pid (None: too late)."""
    deadline = time.time() + GUARD
    while agent.poll() is None and time.time() < deadline:
        if _published(ckpt) >= at_least:
            pid = _workers(agent.pid).get(rank)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                return pid
        time.sleep(0.01)
    return None


def _losses(metrics) -> list[dict]:
    return [r for r in map(json.loads, open(metrics)) if "loss" in r]


def test_killed_worker_restarts_and_resumes_to_the_same_losses(tmp_path):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    env = _fake_slurm(tmp_path, "localhost", 0, SLURM_JOB_NODELIST="localhost")
    ref = subprocess.run(["bash", os.path.join(ROOT, "tools/launch_slurm.sh"), "--nproc-per-node", "2",
                          "--max-restarts", "1", "--port", str(_free_port()), *TRAIN, "--save", str(ref_dir),
                          "--load", str(ref_dir), "--metrics-file", str(ref_dir / "m.jsonl")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=GUARD)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert ref.stdout.count(FRESH) == 1 and not LOADING.search(ref.stdout)

    run_dir.mkdir()
    with open(run_dir / "out.txt", "w") as out:
        agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node", "2", "--max-restarts", "1", "pretrain_gpt.py", *TRAIN,
                                  "--save", str(run_dir), "--load", str(run_dir),
                                  "--metrics-file", str(run_dir / "m.jsonl")],
                                 env={**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},  # as the launcher sets
                                 cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            killed = _kill_rank_after_checkpoint(agent, run_dir, rank=1, at_least=4)
            agent.wait(timeout=GUARD)
        finally:
            if agent.poll() is None:
                agent.kill()
    text = (run_dir / "out.txt").read_text()
    assert killed is not None, f"the run ended before a checkpoint >= 4 was seen:\n{text[-3000:]}"
    assert agent.returncode == 0, text[-4000:]
    assert text.count(FRESH) == 1  # the first start; the restart found the checkpoint
    assert "warning: torchrun --max-restarts" not in text  # the shared-store warning stays quiet with the variable
    resumed_from = [int(k) for k in LOADING.findall(text)]
    assert len(resumed_from) == 1 and 4 <= resumed_from[0] < ITERS, text[-4000:]

    logged, want = _losses(run_dir / "m.jsonl"), _losses(ref_dir / "m.jsonl")
    its = [r["iteration"] for r in logged]
    jumps = [p for p in range(1, len(its)) if its[p] != its[p - 1] + 1]
    restart = jumps[0] if jumps else resumed_from[0]  # where the restart's records begin (no jump: m == K)
    assert its[:restart] == list(range(1, restart + 1)) and restart >= resumed_from[0]  # killed start: 1..m
    assert its[restart:] == list(range(resumed_from[0] + 1, ITERS + 1))  # the restart: K+1..N
    last = {r["iteration"]: r for r in logged}  # the last record of each iteration
    assert [r["iteration"] for r in want] == list(range(1, ITERS + 1))
    for key in ("loss", "grad_norm", "consumed_samples", "lr"):
        assert [last[r["iteration"]][key] for r in want] == [r[key] for r in want], key  # bitwise on CPU
    assert _published(run_dir) == _published(ref_dir) == ITERS


# -- (c) --distributed-timeout-minutes reaches the world group and every group built on it ----------------------
TIMEOUTS = """
import sys
import torch
from megazero.arguments import parse_config
from megazero.training.run import _start

cfg, _ = parse_config(sys.argv[1:])
_, pstate, _ = _start(cfg, lambda *_: None)
for name in ("world_group", "tp_group", "dp_group", "pp_group", "model_parallel_group", "embedding_group"):
    group = getattr(pstate, name)
    if group is not None:
        print(name, group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


def test_distributed_timeout_reaches_every_group(tmp_path):
    script = tmp_path / "timeouts.py"
    script.write_text(TIMEOUTS)
    results = launch(str(script), ["--tp", "2", "--distributed-timeout-minutes", "0.75"], 2, timeout=GUARD)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        seen = dict(line.split() for line in r.stdout.splitlines())
        assert seen == {"world_group": "45.0", "tp_group": "45.0", "model_parallel_group": "45.0"}, r.stdout
