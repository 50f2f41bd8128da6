"""Restarts: the --load == --save idiom, a worker killed under torchrun, the Slurm launcher, the timeout.

The kill-and-resume test runs one command line on 2 ranks (dp 2, zero 1): once through
tools/launch_slurm.sh with a fake one-node Slurm environment, uninterrupted (the reference, shared
by the module), and then under ``torchrun --max-restarts 1`` with static and with c10d rendezvous,
c10d with and without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (static ignores it), where the test SIGKILLs rank 1 as soon
as a checkpoint at iteration >= 4 is published. torchrun restarts both workers; they resume from
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
import torch

from megazero.checkpoint import storage
from megazero.config import Config
from megazero.training.run import find_checkpoint, validate
from megazero.parallel.state import free_port
from tests.helpers.launch import ROOT, launch, small_corpus_args

GUARD = 300  # seconds: a hang guard for the subprocesses, not a timing assertion
ITERS = 30  # long enough that the kill (at a checkpoint >= 4) lands well before the end
TRAIN = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "2", "--zero", "1", "--train-iters", str(ITERS), "--save-interval", "2"]


def _train() -> list[str]:
    """TRAIN on the small-vocabulary corpus (tests/helpers/launch.py): the subject is the restart, not the data."""
    return [*small_corpus_args(), *TRAIN]


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
    (ckpt / "iter_0000002" / storage.METADATA).write_text(json.dumps(storage.metadata_dict(
        config={}, layout={"tp": 1, "pp": 1, "dp": 1, "virtual_stages": 1, "zero": 0}, iteration=2,
        consumed_samples=32, optimizer_scalars={},
        model={"w": {"shape": [2], "split_dim": None, "dtype": "float32", "padded_rows": False,
                     "files": {"model_tp00_pp00.safetensors": [[0, 2]]}}}, optimizer_files={}, rng_files=False)))
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
        assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]  # no environment workaround
        got = get_args_parser().parse_args(cmd[3:])
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, through tools/launch_slurm.sh: its metrics file and the fake Slurm environment."""
    tmp = tmp_path_factory.mktemp("restart")
    ref_dir, env = tmp / "reference", _fake_slurm(tmp, "localhost", 0, SLURM_JOB_NODELIST="localhost")
    ref = subprocess.run(["bash", os.path.join(ROOT, "tools/launch_slurm.sh"), "--nproc-per-node", "2",
                          "--max-restarts", "1", "--port", str(free_port()), *_train(), "--save", str(ref_dir),
                          "--load", str(ref_dir), "--metrics-file", str(ref_dir / "m.jsonl")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=GUARD)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert ref.stdout.count(FRESH) == 1 and not LOADING.search(ref.stdout)
    assert _published(ref_dir) == ITERS
    return _losses(ref_dir / "m.jsonl"), env


# torchrun's two rendezvous kinds as users spell them: the default (static, one store the agent keeps for
# the whole job) and c10d (--standalone; the agent shares its store with the workers unless the variable is 1)
RENDEZVOUS = {"static": lambda: ["--nnodes", "1", "--node_rank", "0", "--master_addr", "127.0.0.1",
                                 "--master_port", str(free_port())],
              "c10d": lambda: ["--standalone"]}


def test_only_c10d_rendezvous_honours_the_share_variable(monkeypatch):
    """Why static rendezvous is killed once, not also with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: its handler, built
    from torchrun's own arguments as the agent builds it, shares the agent's store whatever the variable says (the
    workers would run what ``static-shared`` runs), where c10d's handler honours it (``c10d-unshared`` differs)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    from torch.distributed.run import config_from_args, parse_args

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # config_from_args sets it
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--nnodes", "1"]
    for args, shares in ((RENDEZVOUS["static"](), True), (c10d, False)):
        config, *_ = config_from_args(parse_args([*args, "--nproc_per_node", "2", "pretrain_gpt.py"]))
        params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                      run_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                      local_addr=config.local_addr, **config.rdzv_configs)
        handler = rendezvous_handler_registry.create_handler(params)
        assert handler.use_agent_store is shares, config.rdzv_backend
        handler.shutdown()


@pytest.mark.parametrize(("rdzv", "share"), [("c10d", "shared"), ("c10d", "unshared"), ("static", "shared")])
def test_killed_worker_restarts_and_resumes_to_the_same_losses(tmp_path, reference, rdzv, share):
    """No environment workaround needed: the restart resumes bitwise with or without the variable.

    ``unshared`` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (static rendezvous ignores it: the test above). A short
    --distributed-timeout-minutes bounds a restart that cannot connect (the bug this guards against).
    """
    want, env = reference
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    env = {k: v for k, v in env.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    if share == "unshared":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with open(run_dir / "out.txt", "w") as out:
        agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *RENDEZVOUS[rdzv](),
                                  "--nproc_per_node", "2", "--max-restarts", "1", "pretrain_gpt.py", *_train(),
                                  "--distributed-timeout-minutes", "1",
                                  "--save", str(run_dir), "--load", str(run_dir),
                                  "--metrics-file", str(run_dir / "m.jsonl")],
                                 env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
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
    resumed_from = [int(k) for k in LOADING.findall(text)]
    assert len(resumed_from) == 1 and 4 <= resumed_from[0] < ITERS, text[-4000:]

    logged = _losses(run_dir / "m.jsonl")
    its = [r["iteration"] for r in logged]
    jumps = [p for p in range(1, len(its)) if its[p] != its[p - 1] + 1]
    restart = jumps[0] if jumps else resumed_from[0]  # where the restart's records begin (no jump: m == K)
    assert its[:restart] == list(range(1, restart + 1)) and restart >= resumed_from[0]  # killed start: 1..m
    assert its[restart:] == list(range(resumed_from[0] + 1, ITERS + 1))  # the restart: K+1..N
    last = {r["iteration"]: r for r in logged}  # the last record of each iteration
    assert [r["iteration"] for r in want] == list(range(1, ITERS + 1))
    for key in ("loss", "grad_norm", "consumed_samples", "lr"):
        assert [last[r["iteration"]][key] for r in want] == [r[key] for r in want], key  # bitwise on CPU
    assert _published(run_dir) == ITERS


# -- (b2) the same, staged: one agent store kept across three attempts, a different rank late each time ---------
ATTEMPT = """
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from megazero.parallel.state import init_distributed
from tests.helpers.script_exit import run_then_exit


def main():
    if int(os.environ["RANK"]) == int(sys.argv[1]):  # this attempt's late rank: the other reads the store first
        time.sleep(3)
    init_distributed(torch.device("cpu"), timedelta(seconds=30))
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    print("sum", int(x.item()))


run_then_exit(main)
"""


def test_a_restart_never_reads_the_dead_attempts_keys(tmp_path):
    """What torchrun's agent does, without its timing: the store outlives each attempt's workers.

    With the agent's store joined under fixed key names, the early rank of a later attempt reads the
    late rank's address from the dead attempt and fails to connect (late rank 1) or finds the dead
    rank 0's store entry (late rank 0); a store per attempt answers only its own workers.
    """
    script = tmp_path / "attempt.py"
    script.write_text(ATTEMPT)
    agent = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    for attempt, late in enumerate((-1, 1, 0)):
        env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": str(agent.port),
               "TORCHELASTIC_RUN_ID": "staged", "TORCHELASTIC_RESTART_COUNT": str(attempt)}
        for rank, r in enumerate(launch(str(script), [str(late)], 2, timeout=GUARD, env=env)):
            assert (r.returncode, r.stdout) == (0, "sum 3\n"), (attempt, rank, r.stderr[-3000:])


# -- (c) --distributed-timeout-minutes reaches the world group and every group built on it ----------------------
TIMEOUTS = """
import sys
import torch
from megazero.arguments import parse_config
from megazero.training.run import _start
from tests.helpers.script_exit import run_then_exit


def main():
    cfg, _ = parse_config(sys.argv[1:])
    _, pstate, _ = _start(cfg, lambda *_: None)
    for name in ("world_group", "tp_group", "dp_group", "pp_group", "model_parallel_group", "embedding_group"):
        group = getattr(pstate, name)
        if group is not None:
            print(name, group._get_backend(torch.device("cpu")).options._timeout.total_seconds())


run_then_exit(main)
"""


def test_distributed_timeout_reaches_every_group(tmp_path):
    script = tmp_path / "timeouts.py"
    script.write_text(TIMEOUTS)
    results = launch(str(script), ["--tp", "2", "--distributed-timeout-minutes", "0.75"], 2, timeout=GUARD)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        seen = dict(line.split() for line in r.stdout.splitlines())
        assert seen == {"world_group": "45.0", "tp_group": "45.0", "model_parallel_group": "45.0"}, r.stdout
