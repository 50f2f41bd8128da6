"""Tensor-parallel peers on 2 ranks, on the plain GPT-2 / Llama (``plain_gpt.py``) with megazero's weights.

    --impl dtensor   torch.distributed.tensor.parallel: ColwiseParallel (qkv, fc1), RowwiseParallel
                     (proj, fc2), a vocab-sharded embedding (RowwiseParallel) reused as the tied head
                     (Shard(-1) logits) and loss_parallel cross-entropy.
    --impl megatron  megatron-core ColumnParallelLinear / RowParallelLinear, VocabParallelEmbedding, a
                     ColumnParallelLinear output layer (given the embedding weight when tied) and
                     vocab_parallel_cross_entropy (use_cpu_initialization, gloo).

``--shape`` picks a workload of ``bench/common.py`` SHAPES.

Both shard what megazero's TP shards (the vocabulary included), train with torch
AdamW (decay on matrices) and clip at 1.0 using the TP-aware global norm.
"""
from __future__ import annotations

import argparse

from bench import common
from bench.comm_count import install

COUNTER = install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.peers.plain_gpt import PlainGPT, local_slice, megazero_weights  # noqa: E402


def load_local(module: torch.nn.Module, weights: dict[str, torch.Tensor], rank: int, size: int,
               prefix: str = "") -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(local_slice(prefix + name, weights[prefix + name], rank, size))


def build_dtensor(rank: int, world: int):
    """(loss function of tokens, parameters, is-sharded flags)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    cfg = common.model_config()
    weights = megazero_weights(common.serial_model())
    mesh = init_device_mesh("cpu", (world,))
    model = PlainGPT(cfg)
    model.word = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    if not cfg.tied_embeddings:
        model.output = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    model.load_state_dict(weights)
    plan = {"word": RowwiseParallel(input_layouts=Replicate())}
    for i in range(cfg.num_layers):
        plan.update({f"layers.{i}.qkv": ColwiseParallel(), f"layers.{i}.fc1": ColwiseParallel(),
                     f"layers.{i}.proj": RowwiseParallel(), f"layers.{i}.fc2": RowwiseParallel()})
        if cfg.arch == "llama":
            plan[f"layers.{i}.gate"] = ColwiseParallel()
    if not cfg.tied_embeddings:
        plan["output"] = ColwiseParallel(use_local_output=False)  # Shard(-1) logits
    parallelize_module(model, mesh, plan)

    def loss_fn(tokens: torch.Tensor) -> torch.Tensor:
        x = model.body(model.word(tokens[:, :-1]))
        if cfg.tied_embeddings:
            x = DTensor.from_local(x, mesh, [Replicate()])
            logits = F.linear(x, model.word.weight)  # Shard(-1): vocab-sharded
        else:
            logits = model.output(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        return loss.to_local() if isinstance(loss, DTensor) else loss

    params = list(model.parameters())
    sharded = [isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements) for p in params]
    return loss_fn, model, params, sharded


def build_megatron(rank: int, world: int):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               vocab_parallel_cross_entropy)

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    mcfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                               perform_initialization=False, params_dtype=torch.float32)
    init = torch.nn.init.zeros_

    class Col(torch.nn.Module):
        def __init__(self, n_in: int, n_out: int, bias: bool, skip_weight: bool = False) -> None:
            super().__init__()
            self.inner = ColumnParallelLinear(n_in, n_out, config=mcfg, init_method=init, bias=bias,
                                              gather_output=False, skip_weight_param_allocation=skip_weight)

        def forward(self, x, weight=None):
            return self.inner(x, weight=weight)[0]

    class Row(torch.nn.Module):
        def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
            super().__init__()
            self.inner = RowParallelLinear(n_in, n_out, config=mcfg, init_method=init, bias=bias,
                                           input_is_parallel=True, skip_bias_add=False)

        def forward(self, x):
            return self.inner(x)[0]

    cfg = common.model_config()
    model = PlainGPT(cfg, lambda kind, n_in, n_out, bias: (Col if kind == "column" else Row)(n_in, n_out, bias))
    model.word = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, init_method=init, config=mcfg)
    # the output layer as Megatron's GPTModel builds it: a ColumnParallelLinear, given the shared
    # embedding weight when tied (its input-gradient all-reduce overlaps the weight-gradient GEMM)
    model.output = Col(cfg.hidden_size, cfg.vocab_size, False, skip_weight=cfg.tied_embeddings)
    weights = megazero_weights(common.serial_model())
    names = {n.replace(".inner", ""): p for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in names.items():
            p.copy_(local_slice(name, weights[name], rank, world))

    def loss_fn(tokens: torch.Tensor) -> torch.Tensor:
        x = model.body(model.word(tokens[:, :-1]))
        logits = model.output(x, model.word.weight if cfg.tied_embeddings else None)
        loss = vocab_parallel_cross_entropy(logits, tokens[:, 1:]).mean()
        loss.backward()
        return loss

    params = list(model.parameters())
    split = {"qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias", "gate.weight", "proj.weight", "fc2.weight"}
    sharded = [n.replace(".inner", "").split(".", 2)[-1] in split or n in ("word.weight", "output.inner.weight")
               for n, _ in model.named_parameters()]
    return loss_fn, model, params, sharded


def clip_(params: list, sharded: list[bool], max_norm: float) -> None:
    """Clip to the global L2 norm: sharded grads summed over TP ranks, replicated ones counted once."""
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    sq_sharded = sum((g.pow(2).sum() for g, s in zip(local, sharded) if s), torch.zeros(()))
    sq_repl = sum((g.pow(2).sum() for g, s in zip(local, sharded) if not s), torch.zeros(()))
    dist.all_reduce(sq_sharded)
    coef = max_norm / (float((sq_sharded + sq_repl).sqrt()) + 1e-6)
    if coef < 1.0:
        for g in local:
            g.mul_(coef)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("dtensor", "megatron"), required=True)
    common.add_workload_args(parser)
    parser.add_argument("--shape", default="default", help="a workload of bench/common.py SHAPES")
    args = parser.parse_args()
    common.use_shape(args.shape)
    work = common.Workload(args.steps, args.warmup)
    rank, world = common.init_world()
    loss_fn, model, params, sharded = (build_dtensor if args.impl == "dtensor" else build_megatron)(rank, world)
    opt = common.make_adamw(params)
    data = common.tokens(work.total)
    losses, timer, prof = [], common.StepTimer(work), None
    for step in range(work.total):
        timer.before(step)
        prof = common.maybe_profile(step, work, prof)
        COUNTER.enabled = step >= work.warmup
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(data[step])
        if step == work.total - 1:
            state = common.model_state_bytes(model, opt)
        clip_(params, sharded, common.CLIP)
        opt.step()
        losses.append(float(loss))
    timer.finish()
    common.maybe_profile(work.total, work, prof)
    COUNTER.enabled = False
    comm = COUNTER.take()
    state = max(state, common.model_state_bytes(model, opt))
    common.report(args.impl, work, timer, losses, comm, state, {"world": world})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
