"""The GPU path's CPU-checkable parts (no ``cuda`` marker: these run on every machine).

- ``prepare_cuda_env`` sets CUDA_DEVICE_MAX_CONNECTIONS=1 only for CUDA (or auto) with tp > 1,
  CUBLAS_WORKSPACE_CONFIG only with --deterministic, and never replaces a value the user set;
- ``to_device`` leaves a CPU batch as it is (no copy);
- the NCCL test's collective checks pass on gloo (2 ranks), so they are right before a GPU runs them;
- bench/gpu_mfu.py on the CPU: its TFLOP/s and tokens/s are the trainer's per-step figures of the
  timed steps (warm-up excluded), combined over the mean step time, MFU without and HFU with the
  recomputed forward; ``--ladder`` runs its six rungs in one process, each with its own settings;
- ``make gpu-check`` without a GPU prints its skip line and exits 0.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from megazero.arguments import parse_config
from megazero.data import to_device
from megazero.training.device_setup import CUBLAS_WORKSPACE, MAX_CONNECTIONS, prepare_cuda_env
from tests.helpers.collective_checks import collective_problems, collective_results
from tests.helpers.dist import spawn
from tests.helpers.launch import ROOT, TEST_VOCAB, run_python, small_corpus_args


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


def gpu_mfu_on_cpu(tmp_path, *flags: str) -> tuple[list[str], list[dict]]:
    """bench/gpu_mfu.py on the tiny model on the CPU: its stdout lines and the trainer's step records. The
    arithmetic checked does not depend on the vocabulary: the run trains on the small corpus (vocabulary 512,
    ``small_corpus_args``; the bench passes unknown flags to the run), not the default corpus's 8000."""
    metrics = tmp_path / "mfu.jsonl"
    out = run_python(["bench/gpu_mfu.py", "--device", "cpu", "--config", "configs/tiny.yaml", "--vocab-size",
                      str(TEST_VOCAB), *small_corpus_args(), "--micro-batch-size", "2", "--warmup", "1", "--iters",
                      "2", "--peak-tflops", "0.5", "--metrics-file", str(metrics), *flags], timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r]
    return out.stdout.splitlines(), steps


def check_run_figures(result: dict, timed: list[dict]) -> None:
    """The bench's figures are over the mean step time (so their inverses are the means of the per-step
    inverses); MFU counts model FLOPs, HFU the recomputed forward too."""
    assert result["steps"] == len(timed) == 2
    assert 1 / result["hw_tflops"] == pytest.approx(sum(1 / r["tflops_per_device"] for r in timed) / 2, rel=1e-9)
    assert 1 / result["tokens_per_s"] == pytest.approx(sum(1 / r["tokens_per_sec"] for r in timed) / 2, rel=1e-9)
    assert result["tflops"] / result["hw_tflops"] == pytest.approx(
        result["flops_per_token"] / result["hw_flops_per_token"], rel=1e-12)
    assert result["mfu"] == pytest.approx(result["tflops"] / 0.5, rel=1e-12)
    assert result["hfu"] == pytest.approx(result["hw_tflops"] / 0.5, rel=1e-12)
    assert result["final_loss"] == timed[-1]["loss"]


def test_gpu_mfu_arithmetic_on_cpu(tmp_path):
    lines, steps = gpu_mfu_on_cpu(tmp_path, "--grad-accum", "1")
    result = json.loads(next(line for line in lines if line.startswith("GPU_MFU_RESULT "))[15:])
    assert result["tokens_per_step"] == 2 * 128
    check_run_figures(result, [r for r in steps if r["iteration"] > 1])


def test_gpu_mfu_ladder_on_cpu(tmp_path):
    """Every rung runs in one process with its own settings; the recompute rungs' MFU leaves the recomputed
    forward out, and the last rung doubles the micro-batch at the same tokens per step."""
    lines, steps = gpu_mfu_on_cpu(tmp_path, "--grad-accum", "2", "--ladder", "--compile-backend", "aot_eager",
                                  "--cross-entropy-chunk-size", "64", "--memory-budget-gb", "64")
    ladder = json.loads(next(line for line in lines if line.startswith("GPU_MFU_LADDER "))[15:])["rungs"]
    assert [r["rung"].split(",")[0] for r in ladder] == [
        "eager", "+ best SDPA backend", "+ --compile", "+ fused head and cross entropy",
        "+ planner's recompute (auto)", "+ 2x micro-batch"]
    assert [r["recompute"] for r in ladder] == ["selective"] * 4 + ["none"] * 2  # 64 GiB fits the tiny model
    assert [r["micro_batch_size"] for r in ladder] == [2] * 5 + [4]
    assert {r["tokens_per_step"] for r in ladder} == {4 * 128}
    assert all(r["hw_flops_per_token"] > r["flops_per_token"] for r in ladder[:4])
    assert all(r["hw_flops_per_token"] == r["flops_per_token"] for r in ladder[4:])
    per_run = [steps[i:i + 3] for i in range(0, len(steps), 3)]  # each rung: 1 warm-up + 2 timed steps
    assert len(per_run) == len(ladder) and all([r["iteration"] for r in run] == [1, 2, 3] for run in per_run)
    for result, run in zip(ladder, per_run):
        check_run_figures(result, run[1:])
    attention = [line for line in lines if "attention: SDPA" in line]
    assert "MATH" in attention[0] and "MATH" not in attention[1], attention
    # same data and seed on every rung: the first step's loss agrees across kernels and the fused head
    assert all(abs(run[0]["loss"] - per_run[0][0]["loss"]) < 1e-4 for run in per_run[:5])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine `make gpu-check` runs the GPU suite")
def test_make_gpu_check_skips_cleanly_without_a_gpu():
    out = subprocess.run(["make", "-s", "gpu-check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("gpu-check: skipped: no CUDA GPU visible"), out.stdout
