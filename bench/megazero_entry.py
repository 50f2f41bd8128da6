"""One megazero layout on the benchmark workload: ``--tp/--pp/--zero/--schedule/--vp``, world = tp*pp*dp.

Built from the library's own pieces (``build_training_model``,
``build_schedule``) and driven step by step here, so the loop is the same shape
as every peer's: zero_grad, schedule over the micro-batches, optimizer step.
Run with world size 1 it is the single-process reference every row's loss
sequence is compared with.
"""
from __future__ import annotations

import argparse

from bench import common
from bench.comm_count import install

COUNTER = install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def build_config(args: argparse.Namespace, dp: int):
    from megazero.config import Config

    micro = common.GLOBAL_BATCH // (dp * args.micro_batches)
    settings = {**common.MODEL, "tensor_model_parallel_size": args.tp, "pipeline_model_parallel_size": args.pp,
                "zero": args.zero, "pipeline_schedule": args.schedule, "virtual_pipeline_size": args.vp,
                "micro_batch_size": micro, "global_batch_size": common.GLOBAL_BATCH, "seed": common.SEED,
                "device": "cpu", "lr": common.LR, "lr_decay_style": "constant", "weight_decay": common.WEIGHT_DECAY,
                "adam_beta1": common.BETAS[0], "adam_beta2": common.BETAS[1], "adam_eps": common.EPS,
                "clip_grad": common.CLIP}
    if args.bucket_size:
        settings["bucket_size"] = args.bucket_size
    if args.no_reshard:
        settings["reshard_after_forward"] = False
    return Config.from_flat(settings)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--schedule", default=None)
    parser.add_argument("--vp", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step per DP rank")
    parser.add_argument("--bucket-size", type=int, default=0)
    parser.add_argument("--no-reshard", action="store_true", help="ZeRO 3: keep units gathered until backward")
    parser.add_argument("--name", default="megazero")
    parser.add_argument("--shape", default="default", help="a workload of bench/common.py SHAPES")
    common.add_workload_args(parser)
    return parser.parse_args()


def main() -> None:
    args = _parse_args()
    common.use_shape(args.shape)
    work = common.Workload(args.steps, args.warmup)
    from megazero.training.host_memory import keep_freed_host_memory

    keep_freed_host_memory()  # as megazero's trainer does on CPU
    rank, world = common.init_world()

    from megazero.optimizer.accounting import measured_state_bytes as mz_state_bytes
    from megazero.parallel.state import ParallelState
    from megazero.pipeline.schedules import build_schedule
    from megazero.run_plan import RunPlan
    from megazero.tensor_parallel.random import seed_everything
    from megazero.training.parallelize import build_training_model

    cfg = build_config(args, world // (args.tp * args.pp))  # the micro-batch that gives --micro-batches per step
    plan = RunPlan.resolve(cfg, world)
    pstate = ParallelState.build(plan.layout, "cpu") if world > 1 else ParallelState.serial("cpu")
    seed_everything(common.SEED, pstate.pp_rank)
    model = build_training_model(cfg, plan, pstate)
    chunks, opt = model.chunks, model.optimizer
    schedule = build_schedule(plan)
    data = common.tokens(work.total)
    per_dp = common.GLOBAL_BATCH // pstate.dp
    micro = per_dp // args.micro_batches
    losses, timer, prof = [], common.StepTimer(work), None
    state = own = 0

    def sample(*_) -> None:  # model state at each micro-batch's start: what the previous backward left
        nonlocal state, own
        if step == work.total - 1:
            state, own = max(state, common.model_state_bytes(chunks, opt)), max(own, sum(mz_state_bytes(opt).values()))

    chunks[0].register_forward_pre_hook(sample, prepend=True)
    for step in range(work.total):
        timer.before(step)
        prof = common.maybe_profile(step, work, prof)
        COUNTER.enabled = step >= work.warmup
        local = data[step, pstate.dp_rank * per_dp:(pstate.dp_rank + 1) * per_dp]
        micro_batches = list(local.split(micro))
        opt.zero_grad()
        out = schedule(chunks, micro_batches, pstate, opt.no_sync)
        sample()  # after the last backward: gradients and optimizer state both live
        opt.step(common.LR)
        if out:
            losses.append(float(torch.stack(out).mean()))
    timer.finish()
    common.maybe_profile(work.total, work, prof)
    COUNTER.enabled = False
    comm = COUNTER.take()
    losses = global_losses(pstate, losses)
    state, own = max(state, common.model_state_bytes(chunks, opt)), max(own, sum(mz_state_bytes(opt).values()))
    common.report(args.name, work, timer, losses, comm, state,
                  {"megazero_accounting_bytes": own, "world": world})
    if dist.is_initialized():
        dist.destroy_process_group()


def global_losses(pstate, losses: list[float]) -> list[float]:
    """Mean over DP ranks of the last stage's per-step losses (metadata, after the timed window)."""
    if not dist.is_initialized():
        return losses
    mine = losses if pstate.is_last_stage and pstate.tp_rank == 0 else None
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    lists = [x for x in everyone if x]
    return [sum(v) / len(v) for v in zip(*lists)]


if __name__ == "__main__":
    main()
