"""Worker side of the ZeRO 3 tests (``test_zero3.py``): training runs with a gathered-memory probe,
the per-step communication ledger and the model-state bytes, measured on every rank.

The probe reads what is really allocated - the bytes of each bucket's full-size parameter
storage, ``b.param.untyped_storage().nbytes()`` - never the units' own ``gathered`` flags, so a
unit that said it was freed but kept its bytes would be caught. It records a snapshot at every
block's forward (its forward pre-hook, registered after the optimizer's, so the block's unit has
just been gathered) and every block's pre-backward (a hook on the block's output, registered
after the optimizer's regather hook), and after every ``optimizer.step``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megazero.config import Config
from megazero.memory.params import model_state_bytes
from megazero.model.chunk import blocks_of
from megazero.optimizer.accounting import measured_state_bytes
from megazero.data_parallel.zero3 import Unit
from megazero.optimizer.zero import DistributedOptimizer
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.training.evaluate import evaluate
from megazero.training.parallelize import TrainingModel
from tests.helpers.optimizer_harness import SyntheticBatches, build, make_cfg, train

EVAL_BATCHES = 1


def unit_bytes(unit: Unit) -> list[tuple[int, int]]:
    """(allocated, full-size) bytes of each bucket of ``unit``'s parameter storage."""
    return [(b.param.untyped_storage().nbytes(), b.numel * b.param.element_size()) for _, b in unit.buckets]


def gathered_bytes(opt: DistributedOptimizer) -> int:
    """Bytes of full-size parameter storage this rank holds now (0 when every unit is freed)."""
    return sum(b.param.untyped_storage().nbytes() for buf in opt.buffers for b in buf.buckets)


class UnitProbe:
    """Snapshots of which units hold their bytes, taken at every block's forward and pre-backward;
    ``problems`` lists every broken invariant (empty when ZeRO 3 frees what it should)."""

    def __init__(self, model: TrainingModel, cfg: Config) -> None:
        chunks, opt = model.chunks, model.optimizer
        self.opt, self.prefetch = opt, cfg.parallel.zero3_prefetch
        self.reshard = cfg.parallel.reshard_after_forward
        self.chunk_units: list[list[Unit]] = model.engine.units.chunks
        self.phase = "train"
        self.problems: list[str] = []
        self.peak_blocks = self.peak_bytes = self.events = 0
        self.between_steps: list[int] = []
        self.block_units: set[tuple[int, int]] = set()  # (chunk, unit index) of units made of blocks
        for c, (chunk, units) in enumerate(zip(chunks, self.chunk_units)):
            unit_of = {id(p): u.index for u in units for p in u.params}
            self.block_units |= {(c, unit_of[id(p)]) for block in blocks_of(chunk) for p in block.parameters()}
            for block in blocks_of(chunk):
                index = unit_of[id(next(block.parameters()))]
                block.register_forward_pre_hook(self._on_forward(c, index))
                block.register_forward_hook(self._on_output(c, index))
        step = opt.step

        def step_then_check(lr: float):
            result = step(lr)
            self.between_steps.append(gathered_bytes(opt))
            return result

        opt.step = step_then_check  # instance attribute: this run's optimizer only

    def _on_forward(self, c: int, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self.check(f"{self.phase} forward", c, index)

        return hook

    def _on_output(self, c: int, index: int):
        def hook(module: nn.Module, args: tuple, out) -> None:
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: self.check("pre-backward", c, index))

        return hook

    def check(self, where: str, c: int, index: int) -> None:
        """Every unit all-or-nothing; the computing unit gathered; at most 1 + prefetch block units
        gathered while resharding (and in evaluation); all earlier block units of the chunk still
        gathered when not resharding."""
        self.events += 1
        tag = f"{where} of chunk {c} unit {index}"
        gathered: set[tuple[int, int]] = set()
        for ci, units in enumerate(self.chunk_units):
            for u in units:
                sizes = unit_bytes(u)
                if all(have == full for have, full in sizes):
                    gathered.add((ci, u.index))
                elif any(have for have, _ in sizes):
                    self.problems.append(f"{tag}: chunk {ci} unit {u.index} partly gathered {sizes}")
        blocks = gathered & self.block_units
        self.peak_blocks = max(self.peak_blocks, len(blocks))
        self.peak_bytes = max(self.peak_bytes, gathered_bytes(self.opt))
        if (c, index) not in gathered:
            self.problems.append(f"{tag}: the computing unit is not gathered")
        if (self.reshard or self.phase == "eval") and len(blocks) > 1 + self.prefetch:
            self.problems.append(f"{tag}: {len(blocks)} block units gathered {sorted(blocks)}, "
                                 f"prefetch {self.prefetch}")
        if not self.reshard and self.phase == "train":
            missing = [i for i in range(index) if (c, i) in self.block_units and (c, i) not in gathered]
            if missing:
                self.problems.append(f"{tag}: kept units {missing} were freed before their backward")

    def summary(self) -> dict[str, Any]:
        return {"problems": self.problems[:10], "peak_blocks": self.peak_blocks, "peak_bytes": self.peak_bytes,
                "events": self.events, "between_steps": self.between_steps}


def checked_run(pstate: ParallelState, cfg: Config) -> dict[str, Any]:
    """``harness.train`` plus, after training, one evaluation (forward under no_grad) of the trained
    model; ZeRO 3 runs carry the probe through both and report what is gathered afterwards."""
    built: dict[str, Any] = {}

    def attach(model, _pstate) -> None:
        built.update(chunks=model.chunks, opt=model.optimizer)
        if cfg.parallel.zero == 3:
            built["probe"] = UnitProbe(model, cfg)

    run = train(pstate, cfg, hook=attach)
    probe: UnitProbe | None = built.get("probe")
    if probe is not None:
        probe.phase = "eval"
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    eval_cfg = make_cfg(gbs=cfg.training.global_batch_size, mbs=cfg.training.micro_batch_size)
    run["eval_loss"] = evaluate(built["chunks"], SyntheticBatches(eval_cfg, pstate.dp_rank, pstate.dp),
                                EVAL_BATCHES, pstate, plan.stage_shape, plan.compute_dtype)["val_loss"]
    if probe is not None:
        run["probe"] = probe.summary()
        run["after_eval_bytes"] = gathered_bytes(built["opt"])
    return run


def run_all(pstate: ParallelState, runs: dict[str, dict], extras: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every run of ``runs`` (make_cfg overrides) in this world, plus the named extra measurements. A config
    asked for twice (the fp32 ZeRO 3 precision pairs are the dp2 "1mb" and "4mb" runs) is trained once: a run
    is a pure function of its config and layout, so both readers get the numbers a second run would give."""
    done: list[tuple[Config, dict[str, Any]]] = []
    out: dict[str, Any] = {name: checked_once(pstate, make_cfg(**kw), done) for name, kw in runs.items()}
    for extra in extras:
        out[extra] = EXTRAS[extra](pstate, done) if extra in TAKES_DONE else EXTRAS[extra](pstate)
    return out


def checked_once(pstate: ParallelState, cfg: Config, done: list[tuple[Config, dict[str, Any]]]) -> dict[str, Any]:
    """``checked_run`` of ``cfg``, or the result of the equal config already run in this world (``done``)."""
    for seen, result in done:
        if seen == cfg:
            return result
    result = checked_run(pstate, cfg)
    done.append((cfg, result))
    return result


# -- dp 4: traffic per step and model-state bytes ------------------------------------------------
TRAFFIC_RUNS = {  # name: make_cfg overrides (gbs 8 over dp 4: mbs 2 = one micro-batch)
    "fp32": dict(mbs=2), "fp32.keep": dict(mbs=2, reshard=False), "fp32.2mb": dict(mbs=1),
    "bf16+bf16grads": dict(mbs=2, bf16=True, main_grads_dtype="bf16"),
    "bf16+bf16grads.keep": dict(mbs=2, reshard=False, bf16=True, main_grads_dtype="bf16"),
}
STATE_PRECISIONS = {  # name: (training flags, model_state_bytes precision, main grads dtype)
    "bf16+bf16grads": (dict(bf16=True, main_grads_dtype="bf16"), "bf16", "bf16"),
    "bf16+fp32grads": (dict(bf16=True), "bf16", "fp32"),
    "fp32": ({}, "fp32", "fp32"),
}


def padded_bytes(model: TrainingModel) -> dict[str, int]:
    """Bucket bytes (padding included) of root units and block units' parameters, and of all grads."""
    root = block = grads = 0
    for units in model.engine.units.chunks:
        for u in units:
            n = sum(b.numel * b.param.element_size() for _, b in u.buckets)
            root, block = (root + n, block) if u.index == 0 else (root, block + n)
    for buf in model.optimizer.buffers:
        grads += sum(b.numel for b in buf.buckets) * torch.empty((), dtype=buf.grad_dtype).element_size()
    return {"root": root, "block": block, "grads": grads}


def traffic(pstate: ParallelState) -> dict[str, Any]:
    """The ledger of the second step of each TRAFFIC_RUNS run and the bytes it should be made of."""
    out = {}
    for name, kw in TRAFFIC_RUNS.items():
        built: dict = {}
        cfg = make_cfg(zero=3, iters=2, **kw)
        run = train(pstate, cfg, hook=lambda model, _p: built.update(model=model))
        out[name] = {"comm": run["records"][-1]["comm_bytes"], "bytes": padded_bytes(built["model"]),
                     "micro_batches": cfg.training.global_batch_size // (pstate.dp * cfg.training.micro_batch_size)}
    return out


def model_state(pstate: ParallelState) -> dict[str, Any]:
    """Measured model-state bytes right after build (nothing gathered) and ZeRO 3's arithmetic for them."""
    out = {}
    for name, (flags, precision, grads) in STATE_PRECISIONS.items():
        opt = build(pstate, make_cfg(zero=3, mbs=2, hidden=64, bucket=10_000, **flags)).optimizer
        local = sum(p.numel() for buf in opt.buffers for p in buf.params)  # TP/PP-local, as the buffers hold
        expected = model_state_bytes(local, pstate.dp, 3, precision, grads)
        out[name] = {"measured": measured_state_bytes(opt), "expected": expected.total,
                     "gathered": gathered_bytes(opt), "params": local}
    return out


# -- dp 2: ZeRO 3 against ZeRO 2 in reduced precision -----------------------------------------------
PRECISION = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 1024.0}}
PRECISION_RUNS = {  # global batch 8 over dp 2: mbs 4 = one micro-batch, mbs 1 = four
    f"{p}.z{zero}.{m}mb": dict(zero=zero, mbs=4 // m, **PRECISION[p])
    for p in PRECISION for zero in (2, 3) for m in (1, 4)}


def precision_pairs(pstate: ParallelState, done: list[tuple[Config, dict[str, Any]]]) -> dict[str, Any]:
    return {name: checked_once(pstate, make_cfg(**kw), done) for name, kw in PRECISION_RUNS.items()}


EXTRAS = {"traffic": traffic, "model_state": model_state, "precision": precision_pairs}
TAKES_DONE = {"precision"}  # extras that reuse the world's runs of equal configs
