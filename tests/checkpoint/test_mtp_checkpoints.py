"""Checkpoints carry the MTP modules (issue 43): saved once, loaded and re-saved at 5 other layouts, bitwise.

A llama with 2 MTP modules trained 2 iterations in this process and saved; a 4-rank world then walks CHAIN
(tp 2, pp 2 - the MTP modules and a copy of the word embedding on the last stage - tp 2 x pp 2 at ZeRO 3, cp 2,
dp 4 at ZeRO 3), each layout loading the previous one's checkpoint and saving its own at once, and this process
loads the last one back. Every checkpoint holds exactly the origin's tensors (``moe_ckpt.full_contents``, read
without megazero's loader): the weights, the fp32 master weights and both Adam moments, the MTP ones included.
"""
from __future__ import annotations

from typing import Any

import pytest

from megazero.config import Config
from tests.helpers.ckpt_chain import assert_every_checkpoint_is_the_origin, origin_tensors, walk_chain
from tests.helpers.resume import cfg_for

CHAIN: dict[str, dict[str, Any]] = {
    "tp2.z1": dict(tp=2, zero=1),
    "pp2.z0": dict(pp=2, zero=0),
    "tp2.pp2.z3": dict(tp=2, pp=2, zero=3),
    "cp2.z1": dict(cp=2, zero=1),
    "dp4.z3": dict(zero=3),
}


def mtp_cfg(*, cp: int = 1, tp: int = 1, mbs: int = 2, **layout: Any) -> Config:
    """The resume tests' tiny config as a llama with 2 MTP modules, at this layout."""
    return cfg_for(arch="llama", num_query_groups=2, mtp_num_layers=2, context_parallel_size=cp, tp=tp, sp=tp > 1,
                   mbs=mbs, **layout)


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> str:
    return walk_chain(str(tmp_path_factory.mktemp("mtp_ckpt")), CHAIN, mtp_cfg)


def test_mtp_round_trips_across_layouts_are_bitwise(ck):
    origin = origin_tensors(ck)
    assert not any(t.isnan().any() for t in origin.values())
    for part in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "final_norm.weight", "block.mlp.fc1.weight"):
        for k in (0, 1):
            assert f"model/mtp.{k}.{part}" in origin and f"optim/mtp.{k}.{part}/exp_avg" in origin, (k, part)
    assert origin["optim/mtp.1.eh_proj.weight/exp_avg"].abs().max() > 0  # trained, not just initialised
    assert_every_checkpoint_is_the_origin(ck, CHAIN)
