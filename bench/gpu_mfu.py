"""Model FLOPs utilisation of a ~1B Llama trained in bf16 on one GPU, through megazero's real training path.

    python3 -m bench.gpu_mfu                     # configs/llama-1b.yaml, 3 warm-up + 10 timed steps
    python3 -m bench.gpu_mfu --config configs/gpt2-xl.yaml --micro-batch-size 8
    python3 -m bench.gpu_mfu --ladder            # eager -> ... -> larger micro-batch, one run
    python3 -m bench.gpu_mfu --config configs/olmoe-1b-7b.yaml --micro-batch-size 1 --grad-accum 16 \\
        --device-init --main-grads-dtype bf16 --recompute none   # MoE: MFU of the active FLOPs (one H200)
    python3 -m bench.gpu_mfu --device cpu --config configs/tiny.yaml --vocab-size 8000 \\
        --peak-tflops 1 --warmup 1 --iters 2                  # the arithmetic on a CPU, no GPU needed

It runs ``megazero.training.run.run`` (what pretrain_gpt.py runs: the default
corpus, ZeRO 0 on one rank, bf16 weights with fp32 master weights and main
grads), discards the warm-up steps (allocator growth, cuBLAS heuristics), and
reports the timed steps' mean: tokens/s, achieved TFLOP/s (matmul FLOPs per
token from ``megazero/model/flops.py`` x tokens / step time) and MFU against
the GPU's dense bf16 peak (``megazero/training/flops.py``; an unknown GPU
needs ``--peak-tflops``), then the same as one ``GPU_MFU_RESULT {json}`` line.
Step time is the trainer's: CUDA events from before the batch is copied to
after the optimizer step. Any flag this benchmark does not define goes to the run as pretrain_gpt.py
would take it (after the benchmark's own, so it wins: ``--main-grads-dtype bf16``, ``--recompute none``).

MFU = model FLOPs per token (matmuls only, 2 per multiply-add, training = 3x forward, recomputation
left out as PaLM defines it) x tokens/s / peak; HFU counts the recomputed forward work too.

``--ladder`` measures the rungs of the speed ladder one after another in this one process, each
adding one thing to the one before (``RUNGS``): eager with the math SDPA kernel and selective
recompute -> the best SDPA backend -> ``--compile`` -> the fused head and cross entropy -> the
planner's recompute (``--recompute auto``: none when it fits) -> twice the micro-batch (the same
tokens per step), and prints one table and one ``GPU_MFU_LADDER {json}`` line.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.harness import ROOT
from bench.results import results_header
from megazero.arguments import parse_config
from megazero.config import Config
from megazero.memory.params import num_parameters
from megazero.memory.recompute_choice import resolve_recompute
from megazero.model.flops import flops_per_token
from megazero.pipeline import partition
from megazero.run_plan import RunPlan
from megazero.tensor_parallel.layers import spec_of
from megazero.training.flops import device_peak_tflops
from megazero.training.run import run


@dataclass(frozen=True)
class Rung:
    """One step of the ladder: what it adds, and the flags and micro-batch scale of the run it measures."""

    name: str
    flags: list[str] = field(default_factory=list)
    math_sdpa: bool = False  # SDPA restricted to the math kernel (the S x S scores in memory)
    micro_batch_scale: int = 1  # x the micro-batch, / the micro-batches per step (tokens per step unchanged)


def rungs(chunk: int) -> list[Rung]:
    """The ladder, cumulative: each rung keeps what the ones before it turned on."""
    fused = ["--cross-entropy-chunk-size", str(chunk)]
    return [
        Rung("eager, math SDPA, selective recompute", ["--recompute", "selective"], math_sdpa=True),
        Rung("+ best SDPA backend", ["--recompute", "selective"]),
        Rung("+ --compile", ["--recompute", "selective", "--compile"]),
        Rung("+ fused head and cross entropy", ["--recompute", "selective", "--compile", *fused]),
        Rung("+ planner's recompute (auto)", ["--recompute", "auto", "--compile", *fused]),
        Rung("+ 2x micro-batch", ["--recompute", "auto", "--compile", *fused], micro_batch_scale=2),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # others go to the run
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "llama-1b.yaml"), help="model preset (YAML)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--iters", type=int, default=10, help="timed steps")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak TFLOP/s (default: from the GPU's name; needed for an unknown GPU)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary")
    p.add_argument("--metrics-file", default=None, help="also write the trainer's per-step JSON lines here")
    p.add_argument("--ladder", action="store_true", help="measure every rung of the speed ladder (RUNGS)")
    p.add_argument("--cross-entropy-chunk-size", type=int, default=4096, help="--ladder: the fused head's chunk")
    p.add_argument("--compile-backend", default="inductor", help="--ladder: the --compile rungs' backend")
    p.add_argument("--memory-budget-gb", type=float, default=None,
                   help="--recompute auto's budget (default: the GPU's memory; needed on the CPU)")
    p.add_argument("--device-init", action="store_true",
                   help="draw the initial weights with torch's generator on the run's device instead of megazero's "
                        "seeded CPU blocks: the same distributions, seconds instead of minutes for billions of "
                        "weights (OLMoE-1B-7B's 6.9 B); speed does not depend on the values")
    args, args.run_flags = p.parse_known_args(argv)
    return args


def build_config(args: argparse.Namespace, extra: list[str] = (), micro_batch_scale: int = 1) -> Config:
    """The preset with this benchmark's batch, length and precision and ``extra`` flags; everything else
    as pretrain_gpt.py. ``--recompute auto`` is resolved here, so the FLOPs count what runs."""
    mb = args.micro_batch_size * micro_batch_scale
    accum = max(1, args.grad_accum // micro_batch_scale)
    flags = ["--config", args.config, "--device", args.device, "--micro-batch-size", str(mb),
             "--global-batch-size", str(mb * accum), "--train-iters", str(args.warmup + args.iters),
             "--log-interval", "1", "--lr-warmup-iters", "0", "--eval-interval", "0", "--no-fp16", *extra]
    flags += ["--bf16"] if args.device == "cuda" else ["--no-bf16"]  # CPUs have no fast bf16 matmul
    if "--compile" in extra:
        flags += ["--compile-backend", args.compile_backend]
    if args.vocab_size is not None:
        flags += ["--vocab-size", str(args.vocab_size)]
    if args.metrics_file:
        flags += ["--metrics-file", args.metrics_file]
    cfg, _ = parse_config(flags + args.run_flags)
    if cfg.training.recompute == "auto":
        if args.memory_budget_gb is not None:
            cfg = cfg.updated(memory_budget_gb=args.memory_budget_gb)
        cfg, choice = resolve_recompute(cfg, RunPlan.resolve(cfg, 1), args.device)
        print(choice.describe(), flush=True)
    return cfg


def summarise(cfg: Config, records: list[dict], warmup: int, peak_tflops: float | None) -> dict:
    """Mean over the timed steps: step time, tokens/s, model and hardware TFLOP/s per device, MFU and HFU
    (None without a peak)."""
    timed = [r for r in records if "event" not in r and r["iteration"] > warmup]
    if not timed:
        raise ValueError(f"no timed steps after {warmup} warm-up steps; raise --iters")
    step_s = statistics.fmean(r["step_time_ms"] / 1000 for r in timed)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    t = cfg.training
    flops = flops_per_token(cfg.model)  # model FLOPs: what MFU counts
    hw_flops = flops_per_token(cfg.model, t.recompute, t.recompute_num_layers)  # with the recomputed forward
    tflops, hw_tflops = flops * tokens / step_s / 1e12, hw_flops * tokens / step_s / 1e12  # one device
    return {"steps": len(timed), "step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "recompute": t.recompute, "flops_per_token": flops, "hw_flops_per_token": hw_flops,
            "tflops": tflops, "hw_tflops": hw_tflops, "peak_tflops": peak_tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None,
            "hfu": hw_tflops / peak_tflops if peak_tflops else None,
            "peak_memory_gib": max(r["peak_memory_bytes"] for r in timed) / 2**30, "final_loss": timed[-1]["loss"]}


@torch.no_grad()
def _draw_on_device(module: torch.nn.Module, seed: int, tp_group) -> None:
    """``initialize_parameters``'s distributions (normal(0, std) or the constant; padded vocabulary rows zero),
    drawn where each parameter lives by torch's generator. One rank only: the bench runs no TP."""
    torch.manual_seed(seed)
    for param in module.parameters():
        spec = spec_of(param)
        if spec.init_std is None:
            param.fill_(spec.init_value)
        else:
            param.normal_(0.0, spec.init_std)
        if spec.valid_rows is not None:
            param[spec.valid_rows:].zero_()


@contextmanager
def weights_drawn_on_device(enabled: bool):
    """--device-init: the model build draws with ``_draw_on_device`` while this is open."""
    seeded = partition.initialize_parameters
    if enabled:
        partition.initialize_parameters = _draw_on_device
    try:
        yield
    finally:
        partition.initialize_parameters = seeded


def measure(cfg: Config, args: argparse.Namespace, math_sdpa: bool = False) -> dict:
    """One training run of ``cfg`` in this process, summarised; the process is left as it was found."""
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        with sdpa_kernel(SDPBackend.MATH) if math_sdpa else nullcontext(), weights_drawn_on_device(args.device_init):
            records = run(cfg, log_fn=lambda line: print(line, flush=True))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch._dynamo.reset()  # the next rung compiles its own graphs
        gc.collect()
    peak = args.peak_tflops or (device_peak_tflops(torch.device("cuda", 0)) if args.device == "cuda" else None)
    return summarise(cfg, records, args.warmup, peak)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def _percent(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "n/a"


def ladder(args: argparse.Namespace) -> list[dict]:
    """Every rung measured in turn; one table row each."""
    results = []
    for rung in rungs(args.cross_entropy_chunk_size):
        print(f"gpu_mfu: rung {len(results) + 1}: {rung.name}", flush=True)
        cfg = build_config(args, rung.flags, rung.micro_batch_scale)
        s = measure(cfg, args, rung.math_sdpa)
        results.append({"rung": rung.name, "flags": rung.flags, "micro_batch_size": cfg.training.micro_batch_size,
                        **s})
    print("| rung | micro-batch | recompute | ms/step | tokens/s | model TFLOP/s | MFU | HFU | peak allocated GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        peak = f"{r['peak_memory_gib']:.2f}" if args.device == "cuda" else "-"  # the CPU's is RSS, never reset
        print(f"| {r['rung']} | {r['micro_batch_size']} | {r['recompute']} | {r['step_s'] * 1000:.1f} "
              f"| {r['tokens_per_s']:,.0f} | {r['tflops']:.4g} | {_percent(r['mfu'])} | {_percent(r['hfu'])} "
              f"| {peak} |")
    print("GPU_MFU_LADDER " + json.dumps({"device": _device_name(args.device), "torch": torch.__version__,
                                          "config": os.path.basename(args.config), "rungs": results}), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_mfu: no CUDA GPU visible (torch.cuda.is_available() is False); this benchmark needs one "
              "(--device cpu with a small --config checks the arithmetic).", flush=True)
        return 1
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if parse_config(["--config", args.config] + (["--vocab-size", str(args.vocab_size)] if args.vocab_size
                                                 else []))[0].model.vocab_size is None:
        print(f"gpu_mfu: {args.config} sets no vocab_size; pass --vocab-size (8000 for the default corpus).")
        return 2
    print(results_header("bench.gpu_mfu --ladder" if args.ladder else "bench.gpu_mfu"), flush=True)
    if args.ladder:
        ladder(args)
        return 0
    cfg = build_config(args)
    s = measure(cfg, args)
    m, t = cfg.model, cfg.training
    print(f"gpu_mfu: {_device_name(args.device)}, torch {torch.__version__}, {m.arch} "
          f"{num_parameters(m, 1) / 1e9:.3f} B parameters, {'bf16' if t.bf16 else 'fp32'}, "
          f"seq {m.seq_length}, micro-batch {t.micro_batch_size} x {args.grad_accum} = {s['tokens_per_step']} "
          f"tokens per step, recompute {t.recompute}")
    mfu = (f"MFU {_percent(s['mfu'])} (HFU {_percent(s['hfu'])}) of {s['peak_tflops']:.0f} TFLOP/s dense peak"
           if s["mfu"] is not None else "MFU unknown: pass --peak-tflops for this device")
    print(f"gpu_mfu: {s['steps']} timed steps after {args.warmup} warm-up: {s['step_s'] * 1000:.1f} ms/step, "
          f"{s['tokens_per_s']:,.0f} tokens/s, {s['tflops']:.4g} model TFLOP/s "
          f"({s['flops_per_token'] / 1e9:.2f} GFLOP/token), {mfu}")
    print("GPU_MFU_RESULT " + json.dumps({"device": _device_name(args.device), "torch": torch.__version__,
                                          "config": os.path.basename(args.config), **s}), flush=True)
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as pretrain_gpt.py: gloo's teardown at interpreter exit can abort after a good run
