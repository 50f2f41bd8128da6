"""Data-parallel peers on 2 ranks: DDP, DDP + ZeroRedundancyOptimizer, FSDP2 ``fully_shard``.

Every peer trains megazero's serial GPT-2 module (same seeded weights) with
torch AdamW (decay on matrices, clip 1.0), each rank on its half of the
global batch as one micro-batch, like megazero's zero 0/1/2 rows; with
``--micro-batches m`` as m micro-batches whose losses are scaled by 1/m.
``--no-sync-accum`` (FSDP2 only) is FSDP2's other accumulation choice:
``set_requires_gradient_sync(False)`` for micro-batches 1..m-1, so unsharded
gradients accumulate locally and are reduce-scattered once, in the last.

    --mode ddp           DistributedDataParallel (gradient_as_bucket_view)
    --mode zero1         DDP + ZeroRedundancyOptimizer(parameters_as_bucket_view=True)
    --mode fsdp2         fully_shard(reshard_after_forward=False)  (ZeRO-2-like)
    --mode fsdp2-reshard fully_shard(reshard_after_forward=True)   (ZeRO-3)
"""
from __future__ import annotations

import argparse

from bench import common
from bench.comm_count import install

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


def fsdp_params(model: torch.nn.Module) -> list:
    """FSDP2's per-parameter records (``FSDPParam``): where its unsharded parameters and, while
    gradient sync is off, the accumulating unsharded gradients live (not reachable from
    ``model.parameters()``, which are the sharded DTensors)."""
    out = []
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        out += list(group.fsdp_params) if group is not None else []
    return out


def accumulate(model, raw, tokens, args, sample) -> torch.Tensor:
    """Forward and backward of each micro-batch of this rank's ``tokens``; the step's mean loss."""
    total = torch.zeros(())
    chunks = tokens.chunk(args.micro_batches)
    for i, micro in enumerate(chunks):
        if args.no_sync_accum:
            model.set_requires_gradient_sync(i == len(chunks) - 1)
        loss = model(micro[:, :-1], micro[:, 1:]) / len(chunks)
        loss.backward()
        total += loss.detach()
        sample()  # model state after each micro-batch's backward (the accumulated gradients included)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "zero1", "fsdp2", "fsdp2-reshard"), required=True)
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step per rank")
    parser.add_argument("--no-sync-accum", action="store_true",
                        help="FSDP2: no gradient reduce-scatter before the last micro-batch")
    common.add_workload_args(parser)
    args = parser.parse_args()
    if args.no_sync_accum and not args.mode.startswith("fsdp2"):
        raise SystemExit("--no-sync-accum is FSDP2's option (DDP peers have no_sync instead)")
    work = common.Workload(args.steps, args.warmup)
    rank, world = common.init_world()
    model, opt = build(args.mode)
    raw = model.module if hasattr(model, "module") else model
    data = common.tokens(work.total)
    per_rank = common.GLOBAL_BATCH // world
    losses, timer, prof, state = [], common.StepTimer(work), None, 0

    def sample() -> None:
        nonlocal state
        if step == work.total - 1:
            state = max(state, common.model_state_bytes(raw, opt, fsdp_params(raw)))

    for step in range(work.total):
        timer.before(step)
        prof = common.maybe_profile(step, work, prof)
        COUNTER.enabled = step >= work.warmup
        tokens = data[step, rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad(set_to_none=False)
        losses.append(accumulate(model, raw, tokens, args, sample))
        torch.nn.utils.clip_grad_norm_(raw.parameters(), common.CLIP)
        opt.step()
    timer.finish()
    common.maybe_profile(work.total, work, prof)
    COUNTER.enabled = False
    comm = COUNTER.take()
    mean = torch.stack(losses)
    dist.all_reduce(mean)
    state = max(state, common.model_state_bytes(raw, opt, fsdp_params(raw)))  # after backward / after step
    common.report(args.mode, work, timer, (mean / world).tolist(), comm, state, {"world": world})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
