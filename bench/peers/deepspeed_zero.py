"""DeepSpeed ZeRO stage 1, 2 or 3 on 2 CPU ranks (DS_ACCELERATOR=cpu, gloo), fp32.

The engine wraps megazero's serial GPT-2 (same seeded weights) with torch AdamW
as the client optimizer (decay on matrices), gradient clipping 1.0, each rank
one micro-batch of half the global batch, like megazero's zero 1/2/3 rows
(``--micro-batches m``: m micro-batches per step, DeepSpeed's gradient accumulation).
Stage 3 keeps DeepSpeed's own defaults (prefetch, persistence threshold, overlap) but
for the reduce bucket (see ``ds_config``).
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from bench import common
from bench.comm_count import install

COUNTER = install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def ds_config(stage: int, world: int, micro_batches: int = 1) -> dict:
    micro = common.GLOBAL_BATCH // (world * micro_batches)
    zero = {"stage": stage, "contiguous_gradients": True, "reduce_scatter": True}
    if stage < 3:
        zero["overlap_comm"] = False
    else:  # the default (5e8 elements) allocates a 2 GB flat reduce bucket; megazero's zero 2 rows use 1e6
        zero["reduce_bucket_size"] = 1_000_000
    return {
        "train_batch_size": common.GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": micro_batches, "gradient_clipping": common.CLIP,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
        "fp16": {"enabled": False}, "bf16": {"enabled": False},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step per rank")
    common.add_workload_args(parser)
    args = parser.parse_args()
    work = common.Workload(args.steps, args.warmup)
    rank, world = common.init_world()
    import deepspeed

    model = common.serial_model()
    opt = common.make_adamw(model.parameters())
    config = ds_config(args.stage, world, args.micro_batches)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    data = common.tokens(work.total)
    per_rank = common.GLOBAL_BATCH // world
    losses, timer, prof, state = [], common.StepTimer(work), None, 0
    for step in range(work.total):
        timer.before(step)
        prof = common.maybe_profile(step, work, prof)
        COUNTER.enabled = step >= work.warmup
        tokens = data[step, rank * per_rank:(rank + 1) * per_rank]
        step_loss = 0.0
        for micro in tokens.chunk(args.micro_batches):  # the engine scales each loss by 1/m
            loss = engine(micro[:, :-1], micro[:, 1:])
            engine.backward(loss)
            step_loss += loss.detach() / args.micro_batches
            if step == work.total - 1:  # model state with gradients and optimizer state both live
                state = max(state, common.model_state_bytes(model, engine.optimizer))
            engine.step()  # a no-op until the last micro-batch (gradient accumulation boundary)
        losses.append(step_loss)
    timer.finish()
    common.maybe_profile(work.total, work, prof)
    COUNTER.enabled = False
    comm = COUNTER.take()
    mean = torch.stack(losses)
    dist.all_reduce(mean)
    state = max(state, common.model_state_bytes(model, engine.optimizer))  # after backward / after step
    common.report(f"deepspeed-zero{args.stage}", work, timer, (mean / world).tolist(), comm, state,
                  {"world": world})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
