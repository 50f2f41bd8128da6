"""What MuonClip's QK-clip costs a Muon step: the max-logit collection in the attention core and the clip.

One process, one thread, fp32: the same model and batches trained by Muon without and with
``--qk-clip-threshold`` (tau 1e-3, low enough that most heads are clipped every step), the two rows
alternating step by step so load on the machine falls on both alike; medians after one untimed step.
The clip's own time (the [layers, heads] reduction and the row scaling of the master shards and parameters)
is timed around ``DistributedOptimizer.after_update``; the collection is the rest of the difference.

    .venv/bin/python -m bench.bench_qk_clip                  # gpt2 shape: 4 layers, 256 wide, 8 heads, S 512
    .venv/bin/python -m bench.bench_qk_clip --mla            # the same width as a DeepSeek-style MLA llama
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.results import add_out_flag, emit, results_header


def build(args: argparse.Namespace, tau: float | None):
    """(model, optimizer, clip or None, config) for one row; the same seed for both."""
    from megazero.config import Config, LoggingConfig, ModelConfig, OptimizerConfig, TrainingConfig
    from megazero.data_parallel.engine import EngineSettings, GradSyncEngine
    from megazero.model.gpt import GPTModel
    from megazero.model.transformer import TPContext
    from megazero.optimizer.qk_clip import QKClip
    from megazero.optimizer.zero import DistributedOptimizer
    from megazero.parallel.state import ParallelState
    from megazero.tensor_parallel.layers import initialize_parameters

    d = args.hidden // args.heads  # --mla: q/k d + d/2 RoPE, v d, q LoRA hidden/2, latent hidden/4 (DeepSeek's ratios)
    mla = dict(arch="llama", multi_latent_attention=True, q_lora_rank=args.hidden // 2, kv_lora_rank=args.hidden // 4,
               qk_head_dim=d, qk_pos_emb_head_dim=d // 2, v_head_dim=d) if args.mla else dict(arch="gpt2")
    cfg = Config(model=ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                                   seq_length=args.seq, vocab_size=1024, **mla),
                 optimizer=OptimizerConfig(optimizer="muon", lr=0.02, lr_decay_style="constant",
                                           qk_clip_threshold=tau),
                 training=TrainingConfig(micro_batch_size=args.batch, global_batch_size=args.batch, device="cpu"),
                 logging=LoggingConfig(log_interval=1))
    model = GPTModel(cfg.model, TPContext(group=None))
    initialize_parameters(model, 7, None)
    names = {p: n for n, p in model.named_parameters()}
    serial = ParallelState.serial()
    optimizer = DistributedOptimizer(GradSyncEngine([model], serial, EngineSettings()), cfg.optimizer,
                                     muon=(cfg.model, names))
    clip = QKClip(cfg, serial, [model], optimizer) if tau is not None else None
    return model, optimizer, clip, cfg


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per row, each timed step's seconds; "clip" the clip's own seconds in the QK-clip row's steps."""
    torch.set_num_threads(1)
    rows = {"muon": build(args, None), "muon + qk-clip": build(args, 1e-3)}
    clip_times: list[float] = []
    counts: list[int] = []
    _, optimizer, clip, _ = rows["muon + qk-clip"]
    inner = optimizer.after_update

    def timed_clip() -> None:
        start = time.perf_counter()
        inner()
        clip_times.append(time.perf_counter() - start)
        counts.append(clip.clipped)
    optimizer.after_update = timed_clip
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for step in range(args.steps + 1):
        tokens = torch.randint(0, 1024, (args.batch, args.seq + 1), generator=g)
        for name, (model, opt, qk, _) in rows.items():
            start = time.perf_counter()
            if qk is not None:
                qk.start_step()
            opt.zero_grad()
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            opt.step(0.02)
            if step:
                times[name].append(time.perf_counter() - start)
    times["clip"], times["clipped"] = clip_times[1:], [float(c) for c in counts[1:]]
    times.update(core_times(args))
    return times


def core_times(args: argparse.Namespace) -> dict[str, list[float]]:
    """One layer's attention core (forward + backward of the whole batch) without and with the sink."""
    from megazero.context_parallel.logit_max import LogitMax
    from megazero.model.transformer import Attention, TPContext

    _, _, _, cfg = build(args, None)
    attention = Attention(cfg.model, TPContext())
    d = args.hidden // args.heads
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(args.batch, args.heads, args.seq, d, generator=g) for _ in range(4))
    out: dict[str, list[float]] = {"core": [], "core + max logits": []}
    for rep in range(args.steps + 1):
        for name, sink in (("core", None), ("core + max logits", LogitMax(args.heads))):
            attention.logit_max = sink
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            start = time.perf_counter()
            attention.core_attention(*leaves).backward(dout)
            if rep:
                out[name].append(time.perf_counter() - start)
    return out


def table(args: argparse.Namespace, times: dict[str, list[float]]) -> str:
    base, with_clip, clip = (statistics.median(times[k]) for k in ("muon", "muon + qk-clip", "clip"))
    clipped = statistics.mean(times["clipped"])
    pairs = args.seq * (args.seq + 1) // 2
    width = args.hidden // args.heads * (3 if args.mla else 2) // 2  # MLA's q.k width: d + d/2 RoPE
    collect_flops = 2 * args.batch * args.heads * pairs * width * args.layers
    shape = "MLA llama" if args.mla else "gpt2"
    lines = [results_header("bench.bench_qk_clip"), "",
             f"{shape} shape, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, S {args.seq}, batch "
             f"{args.batch}, fp32, 1 thread, one process; tau 1e-3: {clipped:.1f} of {args.layers * args.heads} "
             f"heads clipped per step on average; median of {args.steps} steps", "",
             "| row | ms per step (median) | over Muon |", "|---|---|---|",
             f"| Muon | {base * 1e3:.1f} | |",
             f"| Muon + QK-clip | {with_clip * 1e3:.1f} | {100 * (with_clip / base - 1):+.1f}% |",
             f"| of which the clip (reduce + scale rows) | {clip * 1e3:.2f} | {100 * clip / base:.2f}% |",
             f"| of which the max-logit collection (the rest) | {(with_clip - base - clip) * 1e3:.1f} | "
             f"{100 * (with_clip - base - clip) / base:+.1f}% |", "",
             "| one layer's attention core, forward + backward | ms (median) | |", "|---|---|---|",
             f"| SDPA core | {statistics.median(times['core']) * 1e3:.1f} | |",
             f"| SDPA core + max logits | {statistics.median(times['core + max logits']) * 1e3:.1f} | "
             f"{100 * (statistics.median(times['core + max logits']) / statistics.median(times['core']) - 1):+.1f}% |",
             "",
             f"collection: 2·d FLOPs per attended pair, {collect_flops / 1e9:.2f} GFLOP per step here "
             f"({pairs} causal pairs per sample, layer and head)",
             f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--mla", action="store_true", help="multi-head latent attention instead of gpt2's")
    add_out_flag(parser)
    args = parser.parse_args()
    emit(table(args, measure(args)), args.out)


if __name__ == "__main__":
    main()
