"""A serial model + ZeRO-0 optimizer that can save a checkpoint without torch.distributed.

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
from megazero.model.gpt import GPTModel
from megazero.moe_config import MoEFields
from megazero.model.transformer import TPContext
from megazero.data_parallel.engine import GradSyncEngine
from megazero.optimizer.zero import DistributedOptimizer
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.tensor_parallel.layers import initialize_parameters


def build(arch: str = "gpt2", hidden: int = 32):
    cfg = Config.from_flat({"arch": arch, "num_layers": 2, "hidden_size": hidden, "num_attention_heads": 4,
                            "seq_length": 8, "vocab_size": 200})
    pstate = ParallelState.serial()
    model = GPTModel(cfg.model, TPContext())
    initialize_parameters(model, 1, None)
    return cfg, pstate, [model], DistributedOptimizer(GradSyncEngine([model], pstate), cfg.optimizer)


def save(root: str, iteration: int) -> str:
    cfg, pstate, chunks, optimizer = build()
    ctx = CheckpointContext(root, cfg, RunPlan.resolve(cfg, pstate.layout.world_size), pstate, chunks, optimizer)
    return save_checkpoint(ctx, iteration, 8 * iteration)


def load(root: str, arch: str = "gpt2", hidden: int = 32) -> None:
    """Load the checkpoint under ``root`` into a fresh serial model and optimizer, as a resume does."""
    cfg, pstate, chunks, optimizer = build(arch, hidden)
    folder = storage.resolve(root)
    meta = storage.read_metadata(folder)
    dense_keys = frozenset(ckpt_load.model_keys()) - {f.name for f in dataclasses.fields(MoEFields)}
    cfg = dataclasses.replace(cfg, explicit=dense_keys)  # as if the (dense) model were given by flags
    ckpt_load.merge_config(meta, cfg)
    ckpt_load.load_model_weights(folder, meta, chunks, pstate)
    ckpt_load.load_optimizer_state(folder, meta, optimizer, chunks, pstate)


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
