"""Data-parallel peers on 2 ranks: DDP, DDP + ZeroRedundancyOptimizer, FSDP2 ``fully_shard``.

Every peer trains megazero's serial GPT-2 module (same seeded weights) with
torch AdamW (decay on matrices, clip 1.0), each rank on its half of the
global batch as one micro-batch, like megazero's zero 0/1/2 rows.

    --mode ddp           DistributedDataParallel (gradient_as_bucket_view)
    --mode zero1         DDP + ZeroRedundancyOptimizer(parameters_as_bucket_view=True)
    --mode fsdp2         fully_shard(reshard_after_forward=False)  (ZeRO-2-like)
    --mode fsdp2-reshard fully_shard(reshard_after_forward=True)   (ZeRO-3)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import common  # noqa: E402
from bench.comm_count import install  # noqa: E402

COUNTER = install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def build(mode: str):
    """(module to call, optimizer, clip function) for ``mode``."""
    model = common.serial_model()
    if mode in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, gradient_as_bucket_view=True)
        # DDP's built-in all-reduce is issued from C++, out of reach of the counting wrappers;
        # torch's own Python all-reduce hook does the same all-reduce of each bucket through dist.all_reduce.
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        wrapped.register_comm_hook(None, allreduce_hook)
        if mode == "ddp":
            opt = common.make_adamw(model.parameters())
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(common.adamw_groups(model.parameters()), optimizer_class=torch.optim.AdamW,
                                          parameters_as_bucket_view=True, lr=common.LR, betas=common.BETAS,
                                          eps=common.EPS)
        return wrapped, opt
    from torch.distributed.fsdp import fully_shard

    reshard = mode == "fsdp2-reshard"
    for layer in model.layers.values():
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model, common.make_adamw(model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "zero1", "fsdp2", "fsdp2-reshard"), required=True)
    common.add_workload_args(parser)
    args = parser.parse_args()
    work = common.Workload(args.steps, args.warmup)
    rank, world = common.init_world()
    model, opt = build(args.mode)
    raw = model.module if hasattr(model, "module") else model
    data = common.tokens(work.total)
    per_rank = common.GLOBAL_BATCH // world
    losses, timer, prof = [], common.StepTimer(work), None
    for step in range(work.total):
        timer.before(step)
        prof = common.maybe_profile(step, work, prof)
        COUNTER.enabled = step >= work.warmup
        tokens = data[step, rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad(set_to_none=False)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if step == work.total - 1:  # model state with gradients and optimizer state both live
            state = common.model_state_bytes(raw, opt)
        torch.nn.utils.clip_grad_norm_(raw.parameters(), common.CLIP)
        opt.step()
        losses.append(loss.detach())
    timer.finish()
    common.maybe_profile(work.total, work, prof)
    COUNTER.enabled = False
    comm = COUNTER.take()
    mean = torch.stack(losses)
    dist.all_reduce(mean)
    state = max(state, common.model_state_bytes(raw, opt))  # the larger of: after backward, after step
    common.report(args.mode, work, timer, (mean / world).tolist(), comm, state, {"world": world})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
