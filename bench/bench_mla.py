"""Multi-head latent attention against grouped-query attention of equal attention FLOPs, on this machine (issue 43).

Two measurements, one process, one thread, fp32, medians of ``--repeats`` after one untimed round, the two rows
alternating each round so load from other work falls on both alike:

- training: one attention module (megazero's ``MLA`` and llama's ``Attention``), forward + backward of a
  [s, b, h] input. The GQA shape is chosen, among head counts and query groups at the same hidden size with
  head widths of 64 or 128 and head counts a multiple of 4 (llama's; an odd width such as 144 would time
  the kernel's worse case, not GQA), as
  the one whose attention FLOPs per token (projections + causal core, ``model/flops.py``: the formula MFU uses)
  are nearest MLA's; both counts are printed.
- decoding: a prompt of ``--prompt`` tokens, then ``--decode`` tokens one at a time through the module with
  its cache (MLA's ``LatentKVCache``: kv_lora_rank + qk_pos_emb_head_dim values per token and layer, the
  up-projection absorbed; GQA's ``KVCache``: 2 g d), time per new token and the cache's bytes per token and
  layer. The bytes MLA would cache uncompressed (per head keys of dq + dr and values of dv) are printed too.

    .venv/bin/python -m bench.bench_mla                   # h 1024, 16 heads, DeepSeek-V3's head widths
    .venv/bin/python -m bench.bench_mla --repeats 9 --out bench/RESULTS_mla.md
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Callable

import torch

from bench.results import add_out_flag, emit, results_header


def mla_config(args: argparse.Namespace):
    from megazero.config import ModelConfig

    return ModelConfig(arch="llama", num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                       seq_length=args.seq, vocab_size=128, multi_latent_attention=True,
                       q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                       qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim)


def attention_flops(cfg) -> float:
    """Forward attention FLOPs per token (projections + core): the layer's less its MLP, as ``model/flops.py``."""
    from megazero.model.flops import layer_forward_flops, mlp_forward_flops

    return layer_forward_flops(cfg)[0] - mlp_forward_flops(cfg)


def matched_gqa(mla) -> tuple[object, float]:
    """The llama GQA config at MLA's hidden size whose attention FLOPs are nearest MLA's; (config, its FLOPs)."""
    from megazero.config import ModelConfig

    target, best = attention_flops(mla), None
    h = mla.hidden_size
    for heads, width in itertools.product(range(4, 129, 4), (64, 128)):  # llama's head widths
        for groups in (g for g in range(1, heads + 1) if heads % g == 0 and heads // g in (1, 2, 4, 8)):
            cfg = ModelConfig(arch="llama", num_layers=1, hidden_size=h, num_attention_heads=heads,
                              num_query_groups=groups, kv_channels=width, seq_length=mla.seq_length, vocab_size=128)
            flops = attention_flops(cfg)
            if best is None or abs(flops - target) < abs(best[1] - target):
                best = (cfg, flops)
    assert best is not None
    return best


def build(cfg):
    """The attention module of ``cfg`` (MLA or llama's), initialised as a run initialises it."""
    from megazero.model.mla import MLA
    from megazero.model.transformer import Attention, TPContext
    from megazero.tensor_parallel.layers import initialize_parameters

    module = (MLA if cfg.multi_latent_attention else Attention)(cfg, TPContext(group=None))
    initialize_parameters(module, 7, None)
    return module


def train_step(module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``module`` on ``x``, upstream gradient ``grad``."""
    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(grad)
    return step


def decode_run(module, cfg, args: argparse.Namespace) -> tuple[Callable[[], float], Callable[[], int]]:
    """(one decode of --decode tokens after a --prompt prefill, the last run's cache bytes per token and layer)."""
    from megazero.model.kv_cache import KVCache

    g = torch.Generator().manual_seed(1)
    prompt = torch.randn(args.prompt, args.batch, cfg.hidden_size, generator=g)
    steps = torch.randn(args.decode, 1, args.batch, cfg.hidden_size, generator=g)
    holder: list = []

    def run() -> float:
        """Seconds of the --decode one-token steps (the prefill untimed)."""
        cache = KVCache.for_model(cfg, args.batch, args.prompt + args.decode, dtype=torch.float32)
        with torch.no_grad():
            module(prompt, cache=cache)
            cache.advance(args.prompt)
            start = time.perf_counter()
            for x in steps:
                module(x, cache=cache)
                cache.advance(1)
            elapsed = time.perf_counter() - start
        holder[:] = [cache]
        return elapsed

    def bytes_per_token() -> int:
        cache = holder[0]
        tensors = [*cache.keys, *cache.values, *getattr(cache, "latents", [])]
        return sum(t.numel() * t.element_size() for t in tensors) // (args.batch * cache.capacity)

    return run, bytes_per_token


def alternate(runs: dict[str, Callable[[], float | None]], repeats: int) -> dict[str, float]:
    """Median seconds of each run (its own answer when it times a part of itself), one untimed round first, the
    rows taking turns every round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(repeats + 1):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            start = time.perf_counter()
            own = runs[name]()
            if round_:
                times[name].append(own if own is not None else time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mla = mla_config(args)
    gqa, gqa_flops = matched_gqa(mla)
    modules = {"mla": (build(mla), mla), "gqa": (build(gqa), gqa)}
    x = torch.randn(args.seq, args.batch, args.hidden, requires_grad=True)
    grad = torch.randn(args.seq, args.batch, args.hidden)
    train = alternate({name: train_step(m, x, grad) for name, (m, _) in modules.items()}, args.repeats)
    decoders = {name: decode_run(m, cfg, args) for name, (m, cfg) in modules.items()}
    decode = alternate({name: run for name, (run, _) in decoders.items()}, args.repeats)
    dq, dr, dv = mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim
    return {"mla": mla, "gqa": gqa, "flops": {"mla": attention_flops(mla), "gqa": gqa_flops}, "train_s": train,
            "decode_s": decode, "cache_bytes": {name: count() for name, (_, count) in decoders.items()},
            "expanded_bytes": mla.num_attention_heads * (dq + dr + dv) * 4}


def table(r: dict, args: argparse.Namespace) -> str:
    mla, gqa = r["mla"], r["gqa"]
    tokens = args.seq * args.batch
    per_token = {name: 1e6 * r["decode_s"][name] / args.decode for name in ("mla", "gqa")}
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    lines = [results_header("bench_mla"), "", f"```bash\n.venv/bin/python -m bench.bench_mla {flags}\n```", "",
             f"MLA: h {mla.hidden_size}, {mla.num_attention_heads} heads, q LoRA {mla.q_lora_rank}, kv LoRA "
             f"{mla.kv_lora_rank}, q/k heads {mla.qk_head_dim} + {mla.qk_pos_emb_head_dim} RoPE, v heads "
             f"{mla.v_head_dim}. GQA of nearest attention FLOPs: {gqa.num_attention_heads} heads over "
             f"{gqa.query_groups} groups of width {gqa.head_dim}. s {args.seq}, b {args.batch}, fp32, one thread.",
             "", "| block | attention GFLOP fwd (per sample) | fwd + bwd ms | fwd + bwd GFLOP/s | decode cache "
             "bytes / token / layer | decode us / token |", "| --- | --- | --- | --- | --- | --- |"]
    for name in ("mla", "gqa"):
        fwd = r["flops"][name] * tokens / 1e9
        lines.append(f"| {name} | {fwd / args.batch:.3f} | {1e3 * r['train_s'][name]:.1f} | "
                     f"{3 * fwd / r['train_s'][name]:.1f} | {r['cache_bytes'][name]} | {per_token[name]:.0f} |")
    lines += ["", f"MLA / GQA: attention FLOPs {r['flops']['mla'] / r['flops']['gqa']:.3f}, fwd + bwd time "
              f"{r['train_s']['mla'] / r['train_s']['gqa']:.2f}x, cache bytes "
              f"{r['cache_bytes']['mla'] / r['cache_bytes']['gqa']:.3f}x, decode time per token "
              f"{per_token['mla'] / per_token['gqa']:.2f}x (a prompt of {args.prompt} then {args.decode} tokens "
              f"one at a time, batch {args.batch}, the prefill untimed). MLA's per-head keys and values "
              f"uncompressed would be "
              f"{r['expanded_bytes']} bytes per token and layer: the latent cache is "
              f"{r['expanded_bytes'] / r['cache_bytes']['mla']:.1f}x smaller."]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("hidden", 1024), ("heads", 16), ("q-lora-rank", 384), ("kv-lora-rank", 256),
                          ("qk-head-dim", 128), ("qk-pos-emb-head-dim", 64), ("v-head-dim", 128), ("seq", 512),
                          ("batch", 2), ("prompt", 256), ("decode", 64), ("repeats", 5)):
        p.add_argument(f"--{flag}", type=int, default=default)
    add_out_flag(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    emit(table(measure(args), args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
