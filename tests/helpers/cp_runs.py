"""Context-parallel training runs for parity tests: tiny configs, other layouts built inside one world.

A run trains with the real build functions, optimizer, schedule and ``Trainer``
(``optimizer_harness.train``); the parent compares every iteration's loss and
grad norm and the final weights with the same config trained in one process.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megazero.config import Config, ParallelConfig
from megazero.model.chunk import blocks_of
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from tests.helpers.optimizer_harness import train
from tests.helpers.session_cache import cached
from tests.helpers.tiny_config import degrees, family, tiny_config

VOCAB = 512
RECORD_KEYS = ("loss", "grad_norm", "skipped", "step_time_ms", "tflops_per_device")


def make_cfg(arch: str = "gpt2", *, tp: int = 1, cp: int = 1, pp: int = 1, zero: int = 0, sp: bool = False,
             comm: str = "p2p", a2a: int | None = None, schedule: str | None = None, vp: int | None = None,
             recompute: str = "none", layers: int = 2, seq: int = 32, mbs: int = 2, gbs: int = 4,
             iters: int = 20, dropout: float = 0.0, parallel: dict | None = None,
             training: dict | None = None) -> Config:
    """``tiny_config`` at this layout; ``parallel`` / ``training``: more (flat) settings of those sections."""
    return tiny_config(**degrees(tp=tp, cp=cp, pp=pp, zero=zero, sp=sp, comm=comm, a2a=a2a, schedule=schedule, vp=vp),
                       **(parallel or {}), **family(arch), num_layers=layers, seq_length=seq, vocab_size=VOCAB,
                       hidden_dropout=dropout, micro_batch_size=mbs, global_batch_size=gbs, train_iters=iters,
                       recompute=recompute, **(training or {}))


@dataclass
class CPRun:
    key: str
    cfg: Config
    dp: int = 1  # the layout is (tp, dp, pp, cp) from the config and this


def run_many(pstate: ParallelState, runs: list[CPRun]) -> dict[str, dict[str, Any]]:
    """Every rank trains every run in order, building (collectively) the groups of each new layout."""
    states: dict[tuple, ParallelState] = {}
    out = {}
    for run in runs:
        p = run.cfg.parallel
        key = (p.tp, run.dp, p.pp, p.cp, p.cp_a2a)
        if key not in states:
            states[key] = ParallelState.build(Layout(p.tp, run.dp, p.pp, p.cp), "cpu", cp_a2a=p.cp_a2a)
        seen: list[int] = []  # tokens per sample each block saw: S/cp (S/(cp tp) under SP)

        def count_tokens(model, pstate) -> None:
            for chunk in model.chunks:
                for block in blocks_of(chunk):
                    block.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))

        result = train(states[key], run.cfg, hook=count_tokens)
        out[run.key] = {"records": [{k: r[k] for k in RECORD_KEYS} for r in result["records"]],
                        "params": result["params"], "block_tokens": sorted(set(seen))}
    return out


def serial_config(cfg: Config) -> Config:
    """The same training on one rank: no parallelism, ZeRO 0, nothing offloaded."""
    return replace(cfg, parallel=ParallelConfig())


def serial_reference(cfg: Config) -> dict[str, Any]:
    """The serial run of ``cfg``, once per session for each distinct serial config (``session_cache``)."""
    return cached(_serial_run, serial_config(cfg))


def _serial_run(cfg: Config) -> dict[str, Any]:
    result = train(ParallelState.serial(), cfg)
    return {"records": [{k: r[k] for k in RECORD_KEYS} for r in result["records"]], "params": result["params"]}
