"""The GPU path's CPU-checkable parts (no ``cuda`` marker: these run on every machine).

- ``prepare_cuda_env`` sets CUDA_DEVICE_MAX_CONNECTIONS=1 only for CUDA (or auto) with tp > 1,
  CUBLAS_WORKSPACE_CONFIG only with --deterministic, and never replaces a value the user set;
- ``to_device`` leaves a CPU batch as it is (no copy);
- the NCCL test's collective checks pass on gloo (2 ranks), so they are right before a GPU runs them;
- bench/gpu_mfu.py on the CPU: its TFLOP/s and tokens/s are the trainer's per-step figures of the
  timed steps (warm-up excluded), combined over the mean step time;
- ``make gpu-check`` without a GPU prints its skip line and exits 0.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megazero.arguments import parse_config
from megazero.data import to_device
from megazero.training.device_setup import CUBLAS_WORKSPACE, MAX_CONNECTIONS, prepare_cuda_env
from tests.helpers.collective_checks import collective_problems, collective_results
from tests.helpers.dist import spawn
from tests.helpers.launch import ROOT


def env_for(flags: list[str], env: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    cfg, _ = parse_config(flags)
    env = dict(env or {})
    return prepare_cuda_env(cfg, env), env


def test_cuda_env_is_set_only_where_needed_and_never_over_the_users():
    assert env_for(["--device", "cuda", "--tp", "2"])[1] == {MAX_CONNECTIONS: "1"}
    assert env_for(["--device", "auto", "--tp", "4"])[1] == {MAX_CONNECTIONS: "1"}
    assert env_for(["--device", "cuda", "--tp", "1"])[1] == {}
    assert env_for(["--device", "cpu", "--tp", "2"])[1] == {}
    assert env_for(["--device", "cpu", "--deterministic"])[1] == {CUBLAS_WORKSPACE: ":4096:8"}
    set_now, env = env_for(["--device", "cuda", "--tp", "2", "--deterministic"],
                           {MAX_CONNECTIONS: "8", CUBLAS_WORKSPACE: ":16:8"})
    assert set_now == {} and env == {MAX_CONNECTIONS: "8", CUBLAS_WORKSPACE: ":16:8"}
    assert parse_config([])[0].training.deterministic is False


def test_cpu_batches_stay_where_they_are():
    batch = torch.arange(6).view(2, 3)
    assert to_device(batch, torch.device("cpu")) is batch


def test_collective_checks_pass_on_gloo():
    assert collective_problems(spawn(collective_results, 2, tp=2)) == []


def test_gpu_mfu_arithmetic_on_cpu(tmp_path):
    metrics = tmp_path / "mfu.jsonl"
    out = subprocess.run([sys.executable, "bench/gpu_mfu.py", "--device", "cpu", "--config", "configs/tiny.yaml",
                          "--vocab-size", "8000", "--micro-batch-size", "2", "--grad-accum", "1", "--warmup", "1",
                          "--iters", "2", "--peak-tflops", "0.5", "--metrics-file", str(metrics)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("GPU_MFU_RESULT "))[15:])
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r]
    timed = [r for r in steps if r["iteration"] > 1]
    assert result["steps"] == len(timed) == 2 and result["tokens_per_step"] == 2 * 128
    # the bench's figure is over the mean step time: its inverse is the mean of the per-step inverses
    assert 1 / result["tflops"] == pytest.approx(sum(1 / r["tflops_per_device"] for r in timed) / 2, rel=1e-9)
    assert 1 / result["tokens_per_s"] == pytest.approx(sum(1 / r["tokens_per_sec"] for r in timed) / 2, rel=1e-9)
    assert result["mfu"] == pytest.approx(result["tflops"] / 0.5, rel=1e-12)
    assert result["final_loss"] == timed[-1]["loss"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine `make gpu-check` runs the GPU suite")
def test_make_gpu_check_skips_cleanly_without_a_gpu():
    out = subprocess.run(["make", "-s", "gpu-check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("gpu-check: skipped: no CUDA GPU visible"), out.stdout
