"""Start-up of one rank of a 70B-shaped llama: build time and peak host memory, full draw vs block draw.

The model is Llama-3-70B's shape (hidden 8192, 64 heads, 8 query groups, ffn 28672, vocabulary
128256, untied) at tp 8 x pp 8. One process builds the chunk of ONE rank (tp rank 0 of the first
stage by default: the embedding plus ``--num-layers / 8`` blocks) in bf16, as a run would, with a
fake process group (``torch.testing``'s "fake" backend) standing in for the other 63 ranks: the
build runs no collective, only group sizes and ranks are read.

- ``new``: the library's ``build_chunks`` (meta device, then this rank's storage, then
  ``initialize_parameters``, which draws only the 128-row blocks this rank's slices overlap).
- ``old``: the path before block seeding, kept here only: real fp32 storage, then every parameter's
  FULL tensor drawn from one generator and this rank's chunk kept, then a cast to bf16.

Each (method, tp) pair runs in a fresh subprocess, one at a time, on one thread (as each rank of a
CPU run); the child reports the build's wall time and CPU time (steadier than wall time on a
shared machine), its peak RSS (``ru_maxrss``) and its RSS before the build (imports, fake groups).

Usage: ``.venv/bin/python -m bench.bench_startup [--num-layers 16] [--runs old:8,old:4,new:8,new:4,new:2]``.
The old method at tp 8 peaks near 6 GB (a full 128256 x 8192 fp32 embedding is 4.2 GB).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import zlib

import torch

from bench.harness import ROOT
from bench.results import results_header

MODEL = dict(arch="llama", hidden_size=8192, num_attention_heads=64, num_query_groups=8, ffn_hidden_size=28672,
             vocab_size=128256, untie_embeddings_and_output_weights=True, seq_length=4096, bf16=True)
PP = 8


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@torch.no_grad()
def old_initialize(module: torch.nn.Module, seed: int, tp_group) -> None:
    """The pre-block initialiser: draw each full tensor, keep this rank's chunk (O(full tensor) per rank)."""
    from megazero.parallel.state import group_rank, group_size
    from megazero.tensor_parallel.layers import full_shape, spec_of

    tp, rank = group_size(tp_group), group_rank(tp_group)
    for name, param in module.named_parameters():
        spec = spec_of(param)
        if spec.init_std is None:
            param.fill_(spec.init_value)
            continue
        generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        full = torch.randn(full_shape(param, tp), generator=generator, dtype=torch.float32) * spec.init_std
        if spec.valid_rows is not None:
            full[spec.valid_rows:] = 0
        if spec.split_dim is not None:
            full = full.chunk(tp, dim=spec.split_dim)[rank]
        param.copy_(full)


def old_build(cfg, plan, pstate) -> torch.nn.Module:
    """build_chunks + build_model_chunks's cast as they were: fp32 storage, full draws, then .to(bf16)."""
    from megazero.model.gpt import GPTModel
    from megazero.model.transformer import TPContext
    from megazero.pipeline.partition import chunk_layer_ranges

    layer_ids = chunk_layer_ranges(cfg.model.num_layers, pstate.pp)[pstate.pp_rank][0]
    model = GPTModel(cfg.model, TPContext(group=pstate.tp_group), layer_ids=layer_ids,
                     pre_process=pstate.is_first_stage, post_process=pstate.is_last_stage)
    old_initialize(model, cfg.training.seed, pstate.tp_group)
    return model.to(plan.compute_dtype)


def child(method: str, tp: int, tp_rank: int, pp_rank: int, num_layers: int) -> dict:
    """Build one rank's chunk in this process and measure it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megazero.config import Config
    from megazero.model.chunk import blocks_of
    from megazero.parallel.state import ParallelState
    from megazero.pipeline.partition import build_chunks
    from megazero.run_plan import RunPlan

    cfg = Config.from_flat({**MODEL, "num_layers": num_layers, "tensor_model_parallel_size": tp,
                            "pipeline_model_parallel_size": PP, "micro_batch_size": 1, "global_batch_size": PP})
    plan = RunPlan.resolve(cfg, tp * PP)  # dp 1
    layout = plan.layout
    dist.init_process_group("fake", rank=layout.rank(tp_rank, 0, pp_rank), world_size=layout.world_size,
                            store=FakeStore())
    pstate = ParallelState.build(layout, "cpu")
    before = _rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    model = old_build(cfg, plan, pstate) if method == "old" else build_chunks(cfg, plan, pstate)[0]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    params = list(model.parameters())
    return {"method": method, "tp": tp, "tp_rank": tp_rank, "pp_rank": pp_rank, "num_layers": num_layers,
            "blocks": len(blocks_of(model)), "seconds": seconds, "cpu_seconds": cpu_seconds, "rss_before": before,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "own_params": sum(p.numel() for p in params),
            "own_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtype": str(params[0].dtype), "threads": torch.get_num_threads()}


def run_child(method: str, tp: int, num_layers: int, tp_rank: int, pp_rank: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_startup", "--child", method, "--tp", str(tp),
           "--num-layers", str(num_layers),
           "--tp-rank", str(tp_rank), "--pp-rank", str(pp_rank), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="old:8,new:8,old:4,new:4,new:2", help="method:tp pairs, in order")
    parser.add_argument("--num-layers", type=int, default=16, help="at pp 8: a stage holds num_layers/8 blocks")
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--pp-rank", type=int, default=0, help="0 = first stage (embedding); 7 = last (head)")
    parser.add_argument("--child", choices=("old", "new"), help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the building process")
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(args.threads)
        print(json.dumps(child(args.child, args.tp, args.tp_rank, args.pp_rank, args.num_layers)))
        return
    gb = 2**30
    print(results_header("bench.bench_startup") + "\n")
    print("| method | tp | blocks | own params | own bytes | build s | build CPU s | peak RSS | RSS before build |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in args.runs.split(","):
        method, tp = run.split(":")
        r = run_child(method, int(tp), args.num_layers, args.tp_rank, args.pp_rank, args.threads)
        print(f"| {r['method']} | {r['tp']} | {r['blocks']} | {r['own_params'] / 1e6:.0f}M | "
              f"{r['own_bytes'] / gb:.2f} GiB {r['dtype'][6:]} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | "
              f"{r['peak_rss'] / gb:.2f} GiB | "
              f"{r['rss_before'] / gb:.2f} GiB |", flush=True)


if __name__ == "__main__":
    main()
