"""A checkpoint walked through a chain of layouts: saved once in one process, then loaded and re-saved at each
layout of a 4-rank world in turn, and loaded back in one process, for bitwise layout-free checks.

``cfg_of(**layout)`` builds the model's config at one layout (``mbs``/``iters`` for the one-process runs); the
checkpoints land under ``ck``: ``serial.trained`` (SAVED_AT iterations), ``serial`` (its load-and-save, the
origin every other is compared with), one per chain layout, and ``serial.end`` (the last one loaded back).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from megazero.config import Config
from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn
from tests.helpers.moe_ckpt import full_contents, layout_state, round_trip
from tests.helpers.resume import SAVED_AT, segment

CfgOf = Callable[..., Config]
WORLD = 4  # the ranks every chain layout is saved at
LAYOUT_KEYS = ("tp", "ep", "pp", "cp", "zero")  # what a checkpoint records of the layout that saved it


def walk(pstate: ParallelState, ck: str, chain: dict[str, dict[str, Any]], cfg_of: CfgOf) -> None:
    """Each layout of ``chain`` loads the previous one's checkpoint (the first: ``serial``) and saves its own."""
    source = f"{ck}/serial"
    for name, layout in chain.items():
        cfg = cfg_of(**layout)
        round_trip(layout_state(WORLD, cfg), cfg, source, f"{ck}/{name}")
        source = f"{ck}/{name}"


def walk_chain(ck: str, chain: dict[str, dict[str, Any]], cfg_of: CfgOf) -> str:
    """Train and save in this process, walk ``chain`` on 4 ranks, load the last checkpoint back here."""
    serial = ParallelState.serial()
    segment(serial, cfg_of(mbs=8, iters=SAVED_AT), save=f"{ck}/serial.trained")
    round_trip(serial, cfg_of(mbs=8), f"{ck}/serial.trained", f"{ck}/serial")
    spawn(walk, WORLD, ck, chain, cfg_of)
    round_trip(serial, cfg_of(mbs=8), f"{ck}/{list(chain)[-1]}", f"{ck}/serial.end")
    return ck


def _tensors(contents: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in contents.items() if isinstance(v, torch.Tensor)}


def origin_tensors(ck: str) -> dict[str, torch.Tensor]:
    """The origin checkpoint's tensors, read without megazero's loader."""
    return _tensors(full_contents(f"{ck}/serial"))


def assert_every_checkpoint_is_the_origin(ck: str, chain: dict[str, dict[str, Any]]) -> None:
    """Every chain checkpoint and ``serial.end`` record the layout that saved them and hold exactly the origin's
    tensors and scalars."""
    contents = full_contents(f"{ck}/serial")  # read once: the origin's tensors and scalars
    origin, scalars = _tensors(contents), contents["scalars"]
    for name in [*chain, "serial.end"]:
        got = full_contents(f"{ck}/{name}")
        assert got["scalars"] == scalars, name
        want = {**dict(tp=1, ep=1, pp=1, cp=1, zero=0), **chain.get(name, {})}
        assert {k: got["layout"][k] for k in LAYOUT_KEYS} == {k: want[k] for k in LAYOUT_KEYS}, name
        tensors = _tensors(got)
        assert tensors.keys() == origin.keys(), name
        for key, t in origin.items():
            assert torch.equal(tensors[key], t), f"{name}: {key}"
