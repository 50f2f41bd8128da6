"""The CUDA kernels megazero counts on, checked on a GPU (skipped on CPU by the ``cuda`` marker).

- bf16 training through pretrain_gpt.py with SDPA forced onto the flash backend (forcing raises
  when flash cannot run; the profiler shows its forward and backward ops) gives the losses of the
  same run on the math backend, to bf16 accuracy (2e-2 relative);
- ``adamw_shard_step`` on CUDA shards equals ``torch.optim.AdamW(fused=True)`` bit for bit over
  several steps (weights and both moments): the same fused kernel, fed the same way;
- with 2+ GPUs, megazero's all_reduce / reduce_scatter / all_gather (sync and async) over NCCL give
  the sums and gathers computed locally (``collective_results``; test_gpu_readiness.py runs the
  same function on gloo, so the check itself is exercised without GPUs).
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import pretrain_gpt
from megazero.optimizer.adam import AdamHyper, adamw_shard_step
from tests.helpers.collective_checks import collective_problems, collective_results
from megazero.parallel.state import free_port

pytestmark = pytest.mark.cuda
LLAMA = ["--arch", "llama", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "3", "--log-interval", "1", "--lr", "1e-3", "--device", "cuda", "--bf16"]
FLASH_OPS = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward"}


def train_in_process(tmp_path, monkeypatch, name: str, backend: SDPBackend) -> tuple[list[float], set[str]]:
    """pretrain_gpt.main in this process (a world of one) under ``backend``; (losses, aten ops that ran)."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    metrics = tmp_path / f"{name}.jsonl"
    with sdpa_kernel([backend]), profile(activities=[ProfilerActivity.CPU]) as prof:
        assert pretrain_gpt.main([*LLAMA, "--metrics-file", str(metrics)]) == 0
    ops = {event.key for event in prof.key_averages()}
    return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r], ops


def test_bf16_training_on_flash_attention_matches_math_backend(tmp_path, monkeypatch):
    flash, flash_ops = train_in_process(tmp_path, monkeypatch, "flash", SDPBackend.FLASH_ATTENTION)
    math_, math_ops = train_in_process(tmp_path, monkeypatch, "math", SDPBackend.MATH)
    assert FLASH_OPS <= flash_ops, sorted(op for op in flash_ops if "attention" in op)
    assert not FLASH_OPS & math_ops
    assert len(flash) == 3 and all(abs(f - m) <= 2e-2 * abs(m) for f, m in zip(flash, math_)), (flash, math_)


def test_adamw_shard_step_matches_torch_fused_adamw_on_cuda():
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    sizes, decays = [1000, 37, 4096, 3], [True, False, True, False]
    params = [torch.randn(n, generator=gen).to(device).requires_grad_() for n in sizes]
    master = torch.cat([p.detach() for p in params])  # the shard: every parameter, back to back
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
    runs = ([b for b, d in zip(bounds, decays) if d], [b for b, d in zip(bounds, decays) if not d])
    hyper = AdamHyper(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    reference = torch.optim.AdamW(
        [{"params": [p for p, d in zip(params, decays) if d], "weight_decay": hyper.weight_decay},
         {"params": [p for p, d in zip(params, decays) if not d], "weight_decay": 0.0}],
        lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps, fused=True)
    for step in range(1, 6):
        grads = [torch.randn(n, generator=gen).to(device) for n in sizes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        reference.step()
        adamw_shard_step(master, torch.cat(grads), exp_avg, exp_avg_sq, runs, hyper, step)
    state = [reference.state[p] for p in params]
    assert torch.equal(master, torch.cat([p.detach() for p in params]))
    assert torch.equal(exp_avg, torch.cat([s["exp_avg"] for s in state]))
    assert torch.equal(exp_avg_sq, torch.cat([s["exp_avg_sq"] for s in state]))


def _nccl_rank(rank: int, world: int, init_file: str, out: str) -> None:
    """One NCCL rank on GPU ``rank``: ``collective_results``, or the error, saved to ``out``."""
    import torch.distributed as dist

    from megazero.parallel.layout import Layout
    from megazero.parallel.state import ParallelState

    device = torch.device("cuda", rank)
    try:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=device)
        result = collective_results(ParallelState.build(Layout.from_world(world, world, 1), device))
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - the test shows it
        result = {"error": repr(err)}
    torch.save(result, out)


def nccl_results(world: int) -> list[dict]:
    """``collective_results`` of ``world`` fresh NCCL processes, one GPU each."""
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=_nccl_rank, args=(r, world, os.path.join(tmp, "init"), outs[r]))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
        missing = [r for r, out in enumerate(outs) if not os.path.exists(out)]
        assert not missing, f"NCCL ranks {missing} left no result (crashed or hung)"
        results = [torch.load(out) for out in outs]
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
    assert not errors, errors
    return results


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_nccl_collectives_through_megazero_wrappers():
    assert collective_problems(nccl_results(min(torch.cuda.device_count(), 4))) == []

