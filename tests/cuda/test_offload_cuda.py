"""ZeRO-Offload on one GPU (skipped on CPU by the ``cuda`` marker): same training, state on the host.

- in one process, ZeRO 2 with the optimizer on the host (fp32, fp16): every bucket's grad shard is
  on its way to the host (an event recorded) before the step starts, the host copy equals the
  device shard before the step and the unscaled device shard after it, and after the step the
  device parameters are the host masters (``offload.HostTransfers``);
- ``pretrain_gpt.py`` on one GPU, 4 micro-batches, TF32 off: ``--offload-optimizer cpu`` and
  ``disk`` train the losses of the in-memory run in fp32 (ZeRO 2), bf16 (ZeRO 1) and fp16 (ZeRO 2,
  loss scaling), and ZeRO 3
  with the optimizer on the host (parameter shards on the device, or ``--offload-params cpu``)
  those of ZeRO 3 in memory. The AdamW kernel differs (the host's
  fused CPU AdamW against the device's), so fp32 is held to 1e-6 relative, bf16/fp16 (whose
  weights round the fp32 masters) to 1e-3;
- their memory records: on the device only the parameters and gradients (optimizer bytes 0), on
  the host the fp32 master + both moments (12 bytes per shard element) and the pinned fp32 grad
  shards (4), and the peak allocated device memory falls by at least 80% of the in-memory run's
  optimizer state.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.launch import launch

pytestmark = pytest.mark.cuda
SMALL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6", "--log-interval", "1",
         "--lr", "1e-3", "--bucket-size", "40000", "--device", "cuda"]
NO_TF32 = {"NVIDIA_TF32_OVERRIDE": "0"}


def run(tmp_path, name: str, flags: list[str]) -> tuple[list[float], dict, int]:
    """(losses, the memory record, peak allocated device bytes) of one single-GPU run."""
    metrics = tmp_path / f"{name}.jsonl"
    (result,) = launch("pretrain_gpt.py", [*SMALL, *flags, "--metrics-file", str(metrics)], 1, env=NO_TF32, fresh=True)
    assert result.returncode == 0, f"{name}:\n{result.stderr[-3000:]}"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    memory = next(r for r in rows if r.get("event") == "memory")
    return [r["loss"] for r in steps], memory, max(r["peak_memory_bytes"] for r in steps)


def close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


def check_offloaded(off: dict, ref: dict, off_peak: int, ref_peak: int, param_bytes: int) -> None:
    """Device: params + grads only; host: 12 bytes of state and 4 of grads per shard element."""
    numel = off["params_bytes"] // param_bytes
    assert off["optimizer_bytes"] == 0, off
    assert (off["params_bytes"], off["grads_bytes"]) == (ref["params_bytes"], ref["grads_bytes"]), (off, ref)
    assert off["optimizer_host_bytes"] == 12 * numel, off
    assert off["transfer_host_bytes"] >= 4 * numel, off
    assert ref_peak - off_peak >= 0.8 * ref["optimizer_bytes"], (ref_peak, off_peak, ref)


@pytest.mark.parametrize("precision", [{}, {"fp16": True, "initial_loss_scale": 1024.0}])
def test_grads_go_down_in_backward_and_params_come_back(precision):
    from megazero.parallel.state import ParallelState
    from megazero.pipeline.schedules import build_schedule
    from megazero.run_plan import RunPlan
    from tests.helpers.batches import SyntheticBatches
    from tests.helpers.optimizer_harness import build, make_cfg

    cfg = make_cfg(zero=2, mbs=2, gbs=8, bucket=3000, **precision).updated(device="cuda", offload_optimizer="cpu")
    pstate = ParallelState.serial("cuda")
    model = build(pstate, cfg)
    chunks, opt = model.chunks, model.optimizer
    schedule = build_schedule(RunPlan.resolve(cfg, pstate.layout.world_size))
    batches = SyntheticBatches(cfg, 0, 1)
    buckets = opt.bucket_list
    assert len(buckets) > 2 and opt.transfers is not None
    for _ in range(2):
        opt.zero_grad()
        schedule(chunks, [t.cuda() for t in batches.next_step()], pstate, opt.no_sync)
        assert sorted(opt.transfers.down_events) == list(range(len(buckets)))  # every copy left in backward
        torch.cuda.synchronize()
        for i, (buf, b) in enumerate(buckets):
            assert torch.equal(opt.transfers.views[i], buf.grad_shard(b).float().cpu()), i
        assert not opt.step(1e-3).skipped
        torch.cuda.synchronize()
        for i, _, (master, _, _) in opt.store.sweep(whole=True):
            buf, b = buckets[i]
            assert torch.equal(buf.param_shard(b).cpu(), master.to(buf.param_dtype)), i
            # what AdamW read on the host: the device shard as the step unscaled it (fp16; no clipping here)
            assert torch.equal(opt.transfers.views[i], buf.grad_shard(b).cpu()), i


def test_offload_cpu_and_disk_match_in_memory_on_one_gpu(tmp_path):
    disk = ["--offload-path", str(tmp_path / "offload")]
    ref, ref_mem, ref_peak = run(tmp_path, "z2", ["--zero", "2"])
    for tier in ("cpu", "disk"):
        got, mem, peak = run(tmp_path, f"z2.{tier}", ["--zero", "2", "--offload-optimizer", tier,
                                                      *(disk if tier == "disk" else [])])
        assert close(got, ref, 1e-6), (tier, got, ref)
        if tier == "cpu":
            check_offloaded(mem, ref_mem, peak, ref_peak, param_bytes=4)
        else:  # the state is in the file; the host holds K buckets of it
            assert mem["optimizer_bytes"] == 0 and mem["optimizer_disk_bytes"] == 12 * mem["params_bytes"] // 4

    # bf16 main grads go down cast to fp32 on the device; fp16's host grads are unscaled as the device's
    for prec, zero, extra in (("bf16", "1", ["--main-grads-dtype", "bf16"]), ("fp16", "2", [])):
        flags = ["--zero", zero, f"--{prec}", *extra]
        ref, ref_mem, ref_peak = run(tmp_path, f"z{zero}.{prec}", flags)
        got, mem, peak = run(tmp_path, f"z{zero}.{prec}.cpu", [*flags, "--offload-optimizer", "cpu"])
        assert close(got, ref, 1e-3), (prec, got, ref)
        check_offloaded(mem, ref_mem, peak, ref_peak, param_bytes=2)


def test_zero3_offload_params_cpu_on_one_gpu(tmp_path):
    ref, ref_mem, _ = run(tmp_path, "z3", ["--zero", "3"])
    got, mem, _ = run(tmp_path, "z3.cpu", ["--zero", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu"])
    assert close(got, ref, 1e-6), (got, ref)
    assert mem["optimizer_bytes"] == 0 and mem["params_host_bytes"] > 0, mem
    assert mem["grads_bytes"] == ref_mem["grads_bytes"], (mem, ref_mem)
    assert mem["params_host_bytes"] + mem["params_bytes"] >= ref_mem["params_bytes"], (mem, ref_mem)
    got, mem, _ = run(tmp_path, "z3.opt", ["--zero", "3", "--offload-optimizer", "cpu"])  # params stay
    assert close(got, ref, 1e-6), (got, ref)
    assert mem["optimizer_bytes"] == 0 and mem["params_bytes"] == ref_mem["params_bytes"], (mem, ref_mem)
