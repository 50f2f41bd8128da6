"""torch.distributed.pipelining peers: ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B.

Stages are megazero's own ``GPTModel`` slices (``layer_ids``, ``pre_process``,
``post_process``), seeded by parameter name, so the weights equal every other
entry's; with 2 chunks per rank (interleaved) virtual stage ``c * pp + r``
lives on rank ``r``, as in megazero. The last stage returns logits and the
schedule applies the loss per micro-batch (grads scaled by 1/m). As in
Megatron, the tied word embedding's two copies (first and last stage) have
their gradients summed by one all-reduce, and the clip norm is summed over stages.
"""
from __future__ import annotations

import argparse

from bench import common
from bench.comm_count import install

COUNTER = install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def build_stages(rank: int, pp: int, vp: int) -> list[torch.nn.Module]:
    from megazero.model.gpt import GPTModel
    from megazero.model.transformer import TPContext
    from megazero.tensor_parallel.layers import initialize_parameters

    cfg = common.model_config()
    per = cfg.num_layers // (pp * vp)
    out = []
    for c in range(vp):
        v = c * pp + rank
        model = GPTModel(cfg, TPContext(), layer_ids=range(v * per, (v + 1) * per), pre_process=v == 0,
                         post_process=v == pp * vp - 1)
        initialize_parameters(model, common.SEED, None)
        out.append(model)
    return out


def loss_fn(logits_sbv: torch.Tensor, labels_bs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_sbv.transpose(0, 1).reshape(-1, logits_sbv.shape[-1]), labels_bs.reshape(-1))


def main() -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), required=True)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    common.add_workload_args(parser)
    args = parser.parse_args()
    work = common.Workload(args.steps, args.warmup)
    rank, world = common.init_world()
    assert world == args.pp, (world, args.pp)
    vp = 2 if args.schedule == "interleaved" else 1
    chunks = build_stages(rank, args.pp, vp)
    stages = [PipelineStage(m, c * args.pp + rank, args.pp * vp, torch.device("cpu")) for c, m in enumerate(chunks)]
    m = args.micro_batches
    if vp == 1:
        kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = kind(stages[0], m, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    params = [p for c in chunks for p in c.parameters()]
    opt = common.make_adamw(params)
    first, last = chunks[0].pre_process, chunks[-1].post_process
    emb_group = dist.new_group([0, args.pp - 1])  # first and last stage: the tied embedding's two copies
    words = [c.embedding.word.weight for c in chunks if c.embedding is not None]
    data = common.tokens(work.total)
    losses, timer, prof = [], common.StepTimer(work), None
    for step in range(work.total):
        timer.before(step)
        prof = common.maybe_profile(step, work, prof)
        COUNTER.enabled = step >= work.warmup
        opt.zero_grad(set_to_none=False)
        tokens, step_losses = data[step], []
        if first:
            schedule.step(tokens[:, :-1], target=tokens[:, 1:] if last else None, losses=step_losses)
        elif last:
            schedule.step(target=tokens[:, 1:], losses=step_losses)
        else:
            schedule.step()
        for w in words:
            dist.all_reduce(w.grad, group=emb_group)
        if step == work.total - 1:
            state = common.model_state_bytes(chunks, opt)
        clip_(params, chunks)
        opt.step()
        if last:
            losses.append(float(torch.stack(step_losses).mean()))
    timer.finish()
    common.maybe_profile(work.total, work, prof)
    COUNTER.enabled = False
    comm = COUNTER.take()
    state = max(state, common.model_state_bytes(chunks, opt))
    losses = common.broadcast_losses(losses, src=args.pp - 1)
    common.report(f"torch-{args.schedule}", work, timer, losses, comm, state, {"world": world})
    dist.destroy_process_group()


def clip_(params: list[torch.Tensor], chunks: list[torch.nn.Module]) -> None:
    """Global-norm clip over all stages; the last stage's embedding copy is not counted twice."""
    copies = {id(c.embedding.word.weight) for c in chunks if c.embedding is not None and not c.pre_process}
    sq = sum((p.grad.pow(2).sum() for p in params if id(p) not in copies), torch.zeros(()))
    dist.all_reduce(sq)
    coef = common.CLIP / (float(sq.sqrt()) + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)


if __name__ == "__main__":
    main()
