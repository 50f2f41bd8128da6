"""The one fixed workload every benchmark entry runs, and what each entry reports.

Every entry (megazero or peer) is a script launched as its own world; it runs
``WARMUP`` untimed steps, then ``STEPS`` timed ones, on the same seeded
synthetic tokens, with the same model (megazero's serial GPT-2, or a plain
copy of its weights) and the same AdamW (decay on matrices only, clip 1.0,
constant LR). Rank 0 prints one ``BENCH_RESULT {json}`` line, which the
driver parses; every rank contributes its peak RSS and model-state bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

MODEL = dict(arch="gpt2", num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=4096)
GLOBAL_BATCH = 16
# Other workloads for the TP rows (--shape; "default" is MODEL above): (model settings, global batch).
SHAPES: dict[str, tuple[dict, int]] = {
    "default": (dict(MODEL), GLOBAL_BATCH),
    "small": (dict(arch="gpt2", num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=256,
                   vocab_size=2048), 32),
    "gpt2-small": (dict(arch="gpt2", num_layers=4, hidden_size=384, num_attention_heads=6, seq_length=256,
                        vocab_size=16384), 8),
    "llama-gqa": (dict(arch="llama", num_layers=4, hidden_size=384, num_attention_heads=6, num_query_groups=2,
                       ffn_hidden_size=1024, seq_length=256, vocab_size=8192), 8),
}
SEED = 1234
LR = 3e-4
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.95)
EPS = 1e-8
CLIP = 1.0
WARMUP = 2
STEPS = 8
RESULT_TAG = "BENCH_RESULT "


@dataclass
class Workload:
    steps: int = STEPS
    warmup: int = WARMUP

    @property
    def total(self) -> int:
        return self.steps + self.warmup

    @property
    def tokens_per_step(self) -> int:
        return GLOBAL_BATCH * MODEL["seq_length"]


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=WARMUP)


def use_shape(name: str) -> None:
    """Make ``SHAPES[name]`` the workload of this process (MODEL and GLOBAL_BATCH), before anything is built."""
    global GLOBAL_BATCH
    if name not in SHAPES:
        raise ValueError(f"--shape {name!r} is not one of {sorted(SHAPES)}")
    settings, GLOBAL_BATCH = SHAPES[name]
    MODEL.clear()
    MODEL.update(settings)


def tokens(total_steps: int) -> torch.Tensor:
    """[steps, global_batch, seq+1] seeded synthetic token ids, identical for every entry."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, MODEL["vocab_size"], (total_steps, GLOBAL_BATCH, MODEL["seq_length"] + 1), generator=g)


def model_config():
    from megazero.config import ModelConfig

    return ModelConfig(**MODEL)


def serial_model() -> torch.nn.Module:
    """megazero's GPT-2 at TP=1 as a plain nn.Module, seeded exactly as every megazero layout."""
    from megazero.model.gpt import GPTModel
    from megazero.model.transformer import TPContext
    from megazero.tensor_parallel.layers import initialize_parameters

    model = GPTModel(model_config(), TPContext())
    initialize_parameters(model, SEED, None)
    return model


def adamw_groups(params: Iterable[torch.nn.Parameter]) -> list[dict]:
    """megazero's decay rule (matrices only) for torch.optim.AdamW."""
    params = list(params)
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def make_adamw(params: Iterable[torch.nn.Parameter], **kw) -> torch.optim.AdamW:
    return torch.optim.AdamW(adamw_groups(params), lr=LR, betas=BETAS, eps=EPS, **kw)


def init_world() -> tuple[int, int]:
    """Join the gloo world torchrun-style env vars describe; single-process runs need none."""
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        if hasattr(t, "_local_tensor"):
            t = t._local_tensor
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def reachable_tensors(obj: Any, depth: int = 4, seen: set | None = None) -> list[torch.Tensor]:
    """Tensors reachable from ``obj`` through attributes, lists, tuples and dicts (depth-limited).

    This is how model state is measured for every entry alike: the parameters, their
    ``.grad``, and every tensor the optimizer object holds (moments, master copies,
    flat buffers, gradient partitions). Storages are deduplicated by ``storage_bytes``.
    """
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out = [obj]
        if getattr(obj, "grad", None) is not None:
            out.append(obj.grad)
        main_grad = getattr(obj, "main_grad", None)
        if isinstance(main_grad, torch.Tensor):
            out.append(main_grad)
        return out
    if isinstance(obj, torch.nn.Module):
        return [t for p in obj.parameters() for t in reachable_tensors(p, 0, seen)]
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in reachable_tensors(item, depth - 1, seen)]


def model_state_bytes(*objs: Any) -> int:
    return storage_bytes(reachable_tensors(list(objs), depth=6))


def all_ranks(value: float) -> list[float]:
    """Every rank's ``value`` (outside the counted region; start-up/teardown metadata only)."""
    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class StepTimer:
    """Wall time of the timed steps, synchronised so every rank measures the same window."""

    def __init__(self, work: Workload) -> None:
        self.work, self.start, self.elapsed = work, 0.0, 0.0
        self.cpu_start, self.cpu = 0.0, 0.0  # this process's CPU time: robust to other load on the machine

    def before(self, step: int) -> None:
        if step == self.work.warmup:
            if dist.is_initialized():
                dist.barrier()
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def finish(self) -> None:
        if dist.is_initialized():
            dist.barrier()
        self.elapsed = time.perf_counter() - self.start
        self.cpu = time.process_time() - self.cpu_start


def report(name: str, work: Workload, timer: StepTimer, losses: list[float], comm: dict[str, float],
           state_bytes: int, extra: dict | None = None) -> None:
    """Gather per-rank numbers and print the result line on rank 0 (every rank must call this)."""
    rss = all_ranks(peak_rss_bytes())
    cpu = all_ranks(timer.cpu / max(work.steps, 1))
    states = all_ranks(state_bytes)
    comm_total = all_ranks(sum(comm.values()) / max(work.steps, 1))
    if not dist.is_initialized() or dist.get_rank() == 0:
        record = {
            "name": name, "tokens_per_s": work.tokens_per_step * work.steps / timer.elapsed,
            "step_s": timer.elapsed / work.steps, "peak_rss_bytes": rss, "cpu_s_per_step": cpu,
            "model_state_bytes": states,
            "comm_bytes_per_step": comm_total, "comm_kinds_rank0": {k: v / work.steps for k, v in comm.items()},
            "losses": losses, **(extra or {}),
        }
        print(RESULT_TAG + json.dumps(record), flush=True)


def broadcast_losses(losses: list[float], src: int = 0) -> list[float]:
    """The loss sequence as rank ``src`` saw it (uncounted; called after the timed window)."""
    if not dist.is_initialized():
        return losses
    box = [losses]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def maybe_profile(step: int, work: Workload, prof=None):
    """With BENCH_PROFILE=1, rank BENCH_PROFILE_RANK (0) profiles the timed steps and prints the top ops."""
    rank = int(os.environ.get("BENCH_PROFILE_RANK", "0"))
    if not os.environ.get("BENCH_PROFILE") or (dist.is_initialized() and dist.get_rank() != rank):
        return None
    if step == work.warmup:
        shapes = os.environ["BENCH_PROFILE"] == "shapes"  # BENCH_PROFILE=shapes: top ops per input shape
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=shapes)
        prof.__enter__()
    elif step == work.total and prof is not None:
        prof.__exit__(None, None, None)
        by_shape = os.environ["BENCH_PROFILE"] == "shapes"
        print(prof.key_averages(group_by_input_shape=by_shape).table(sort_by="self_cpu_time_total", row_limit=25),
              file=sys.stderr)
    return prof
