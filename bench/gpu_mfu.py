"""Model FLOPs utilisation of a ~1B Llama trained in bf16 on one GPU, through megazero's real training path.

    PYTHONPATH=. python3 bench/gpu_mfu.py                     # configs/llama-1b.yaml, 3 warm-up + 10 timed steps
    PYTHONPATH=. python3 bench/gpu_mfu.py --config configs/gpt2-xl.yaml --micro-batch-size 8
    PYTHONPATH=. python3 bench/gpu_mfu.py --device cpu --config configs/tiny.yaml --vocab-size 8000 \\
        --peak-tflops 1 --warmup 1 --iters 2                  # the arithmetic on a CPU, no GPU needed

It runs ``megazero.training.run.run`` (what pretrain_gpt.py runs: the default
corpus, ZeRO 0 on one rank, bf16 weights with fp32 master weights and main
grads), discards the warm-up steps (allocator growth, cuBLAS heuristics), and
reports the timed steps' mean: tokens/s, achieved TFLOP/s (matmul FLOPs per
token from ``megazero/model/flops.py`` x tokens / step time) and MFU against
the GPU's dense bf16 peak (``megazero/training/flops.py``; an unknown GPU
needs ``--peak-tflops``), then the same as one ``GPU_MFU_RESULT {json}`` line.
Step time is the trainer's: CUDA events from before the batch is copied to
after the optimizer step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megazero.arguments import parse_config  # noqa: E402
from megazero.config import Config  # noqa: E402
from megazero.memory.params import num_parameters  # noqa: E402
from megazero.model.flops import flops_per_token  # noqa: E402
from megazero.training.flops import device_peak_tflops  # noqa: E402
from megazero.training.run import run  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    """The preset with this benchmark's batch, length and precision; everything else as pretrain_gpt.py."""
    flags = ["--config", args.config, "--device", args.device, "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.micro_batch_size * args.grad_accum),
             "--train-iters", str(args.warmup + args.iters), "--log-interval", "1", "--lr-warmup-iters", "0",
             "--eval-interval", "0", "--no-fp16"]
    flags += ["--bf16"] if args.device == "cuda" else ["--no-bf16"]  # CPUs have no fast bf16 matmul
    if args.vocab_size is not None:
        flags += ["--vocab-size", str(args.vocab_size)]
    if args.metrics_file:
        flags += ["--metrics-file", args.metrics_file]
    cfg, _ = parse_config(flags)
    return cfg


def summarise(cfg: Config, records: list[dict], warmup: int, peak_tflops: float | None) -> dict:
    """Mean over the timed steps: step time, tokens/s, model TFLOP/s per device, MFU (None without a peak)."""
    timed = [r for r in records if "event" not in r and r["iteration"] > warmup]
    if not timed:
        raise ValueError(f"no timed steps after {warmup} warm-up steps; raise --iters")
    step_s = statistics.fmean(r["step_time_ms"] / 1000 for r in timed)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    flops = flops_per_token(cfg.model, cfg.training.recompute, cfg.training.recompute_num_layers)
    tflops = flops * tokens / step_s / 1e12  # one device
    return {"steps": len(timed), "step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "flops_per_token": flops, "tflops": tflops, "peak_tflops": peak_tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None, "final_loss": timed[-1]["loss"]}


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_mfu: no CUDA GPU visible (torch.cuda.is_available() is False); this benchmark needs one "
              "(--device cpu with a small --config checks the arithmetic).", flush=True)
        return 1
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    cfg = build_config(args)
    if cfg.model.vocab_size is None:  # the FLOPs of the output head need it before the run
        print(f"gpu_mfu: {args.config} sets no vocab_size; pass --vocab-size (8000 for the default corpus).")
        return 2
    try:
        records = run(cfg, log_fn=lambda line: print(line, flush=True))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    peak = args.peak_tflops or (device_peak_tflops(torch.device("cuda", 0)) if args.device == "cuda" else None)
    s = summarise(cfg, records, args.warmup, peak)
    m, t = cfg.model, cfg.training
    print(f"gpu_mfu: {_device_name(args.device)}, torch {torch.__version__}, {m.arch} "
          f"{num_parameters(m, 1) / 1e9:.3f} B parameters, {'bf16' if t.bf16 else 'fp32'}, "
          f"seq {m.seq_length}, micro-batch {t.micro_batch_size} x {args.grad_accum} = {s['tokens_per_step']} "
          f"tokens per step")
    mfu = (f"MFU {100 * s['mfu']:.1f}% of {s['peak_tflops']:.0f} TFLOP/s dense peak" if s["mfu"] is not None
           else "MFU unknown: pass --peak-tflops for this device")
    print(f"gpu_mfu: {s['steps']} timed steps after {args.warmup} warm-up: {s['step_s'] * 1000:.1f} ms/step, "
          f"{s['tokens_per_s']:,.0f} tokens/s, {s['tflops']:.4g} TFLOP/s "
          f"({s['flops_per_token'] / 1e9:.2f} GFLOP/token), {mfu}")
    print("GPU_MFU_RESULT " + json.dumps({"device": _device_name(args.device), "torch": torch.__version__,
                                          "config": os.path.basename(args.config), **s}), flush=True)
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as pretrain_gpt.py: gloo's teardown at interpreter exit can abort after a good run
