"""A tiny training model (serial and ZeRO 0 by default) that can save a checkpoint without torch.distributed.

``build``, ``save`` and ``load`` are used in-process by the error tests, and the module as a
subprocess by the crash test:
`python -m tests.helpers.serial_ckpt ROOT ITERATION [--hang-mid-write]`.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from megazero.checkpoint import load as ckpt_load
from megazero.checkpoint import storage
from megazero.checkpoint.save import CheckpointContext, save_checkpoint
from megazero.config import Config
from megazero.moe_config import MoEFields
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.training.parallelize import TrainingModel, Weights, build_training_model


def tiny_cfg(arch: str = "gpt2", hidden: int = 32, zero: int = 0) -> Config:
    return Config.from_flat({"arch": arch, "num_layers": 2, "hidden_size": hidden, "num_attention_heads": 4,
                             "seq_length": 8, "vocab_size": 200, "zero": zero})


def build(arch: str = "gpt2", hidden: int = 32, *, pstate: ParallelState | None = None, zero: int = 0,
          weights: Weights | None = None) -> tuple[Config, ParallelState, TrainingModel]:
    """The tiny model's config, its groups (serial unless ``pstate``) and its training model at ``zero``, built as
    a run builds it (``weights``: a checkpoint folder and its metadata, loaded before the wrap)."""
    cfg = tiny_cfg(arch, hidden, zero)
    pstate = pstate or ParallelState.serial()
    return cfg, pstate, build_training_model(cfg, plan_of(cfg, pstate), pstate, weights=weights)


def plan_of(cfg: Config, pstate: ParallelState) -> RunPlan:
    return RunPlan.resolve(cfg, pstate.layout.world_size)


def save(root: str, iteration: int) -> str:
    cfg, pstate, model = build()
    return save_checkpoint(CheckpointContext(root, cfg, plan_of(cfg, pstate), pstate, model), iteration, 8 * iteration)


def load(root: str, arch: str = "gpt2", hidden: int = 32) -> None:
    """Load the checkpoint under ``root`` into a fresh serial model and optimizer, as a resume does."""
    folder = storage.resolve(root)
    meta = storage.read_metadata(folder)
    cfg = tiny_cfg(arch, hidden)
    typed = dataclasses.replace(cfg, explicit=_typable_dense_keys(cfg))  # as if the (dense) model were typed
    ckpt_load.merge_config(meta, typed)
    _, pstate, model = build(arch, hidden, weights=(folder, meta))
    ckpt_load.load_optimizer_state(folder, meta, model, pstate)


def hang_mid_write(on_half_written=lambda: print("HALF-WRITTEN", flush=True)) -> None:
    """Make the optimizer shard's write stop half way, forever (the test then SIGKILLs us);
    ``on_half_written`` runs once the shard is half on disk (by default it says so on stdout)."""
    import time

    import megazero.checkpoint.save as save_module

    real = save_module.save_file

    def half_then_hang(tensors, path, *args, **kwargs):
        real(tensors, path, *args, **kwargs)
        if "optim" in path:
            with open(path, "r+b") as fh:
                fh.truncate(fh.seek(0, 2) // 2)
            on_half_written()
            time.sleep(600)

    save_module.save_file = half_then_hang


if __name__ == "__main__":
    if "--hang-mid-write" in sys.argv:
        hang_mid_write()
    torch.set_num_threads(1)
    print(save(sys.argv[1], int(sys.argv[2])), flush=True)


def _typable_dense_keys(cfg: Config) -> frozenset[str]:
    """The dense model's keys a user could type for ``cfg``'s model: a setting whose ``applies`` rule fails here
    (YaRN's betas without ``--rope-scaling-type yarn``, MLA's ranks without MLA) would be refused if typed."""
    dense = set(ckpt_load.model_keys()) - {f.name for f in dataclasses.fields(MoEFields)}
    values = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model)}
    refused = {f.name for f in dataclasses.fields(cfg.model)
               if (needs := f.metadata.get("applies")) is not None and all(n in values for n in needs.on)
               and not needs.test(*(values[n] for n in needs.on))}
    return frozenset(dense - refused)
