"""DeepSpeed ZeRO stage 1 or 2 on 2 CPU ranks (DS_ACCELERATOR=cpu, gloo), fp32.

The engine wraps megazero's serial GPT-2 (same seeded weights) with torch AdamW
as the client optimizer (decay on matrices), gradient clipping 1.0, each rank
one micro-batch of half the global batch, like megazero's zero 1/2 rows.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from bench import common  # noqa: E402
from bench.comm_count import install  # noqa: E402

COUNTER = install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def ds_config(stage: int, world: int) -> dict:
    micro = common.GLOBAL_BATCH // world
    return {
        "train_batch_size": common.GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1, "gradient_clipping": common.CLIP,
        "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_scatter": True},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
        "fp16": {"enabled": False}, "bf16": {"enabled": False},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, choices=(1, 2), required=True)
    common.add_workload_args(parser)
    args = parser.parse_args()
    work = common.Workload(args.steps, args.warmup)
    rank, world = common.init_world()
    import deepspeed

    model = common.serial_model()
    opt = common.make_adamw(model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(args.stage, world),
                                           dist_init_required=False)
    data = common.tokens(work.total)
    per_rank = common.GLOBAL_BATCH // world
    losses, timer, prof = [], common.StepTimer(work), None
    for step in range(work.total):
        timer.before(step)
        prof = common.maybe_profile(step, work, prof)
        COUNTER.enabled = step >= work.warmup
        tokens = data[step, rank * per_rank:(rank + 1) * per_rank]
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        if step == work.total - 1:  # model state with gradients and optimizer state both live
            state = common.model_state_bytes(model, engine.optimizer)
        engine.step()
        losses.append(loss.detach())
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
