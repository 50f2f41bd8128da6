"""Configs the Muon tests train: the tiny dense and MoE models with Muon (lr 0.02) and AdamW (lr 1e-3) for the rest."""
from __future__ import annotations

from typing import Any

from megazero.config import Config
from tests.helpers.moe_runs import make_cfg
from tests.helpers.tiny_config import family, tiny_config

ITERS, MUON_LR, ADAM_LR = 20, 0.02, 1e-3
MUON = dict(optimizer="muon", lr=MUON_LR, muon_adam_lr=ADAM_LR)


def muon_cfg(arch: str = "llama", **flat: Any) -> Config:
    """The tiny config trained by Muon with AdamW for the rest, ``ITERS`` iterations of 8 samples."""
    settings = dict(train_iters=ITERS, micro_batch_size=4, global_batch_size=8, **MUON)
    return tiny_config(**family(arch), **{**settings, **flat})


def dense(arch: str = "llama", iters: int = ITERS, **flat: Any) -> Config:
    """The tiny dense config (its own batch) trained by Muon with AdamW for the rest."""
    return tiny_config(**family(arch), **{**MUON, "train_iters": iters, **flat})


def moe(arch: str = "llama", iters: int = ITERS, **kw: Any) -> Config:
    """``moe_runs.make_cfg``'s tiny MoE (E 4, k 2, aux and z losses) trained by Muon."""
    return make_cfg(arch, iters=iters, training={**MUON, **kw.pop("training", {})}, **kw)


def records(result: dict[str, Any]) -> list[tuple[float, float]]:
    """(loss, grad norm) of every iteration of an ``optimizer_harness.train`` result."""
    return [(r["loss"], r["grad_norm"]) for r in result["records"]]


def muon_bytes(record: dict[str, Any]) -> int:
    """The bytes one step's record says Muon's routes sent from this rank (the ledger's ``send.muon``)."""
    return sum(v for k, v in record["comm_bytes"].items() if k.split("/")[0] == "send.muon")
