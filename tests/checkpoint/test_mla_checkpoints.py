"""MLA MoE checkpoints are layout-free (issue 43): saved once, loaded at 9 other (tp, cp, pp, ep, zero) layouts.

The tiny MoE model of tests/helpers/moe_ckpt.py as a llama with --multi-latent-attention (q LoRA, a value head
narrower than the query/key head) and one MTP module (--mtp-num-layers 1, as DeepSeek-V3; its block MLA and MoE
like the last layer, on the last pipeline stage, the word embedding shared with the first): trained 2 iterations
in this process and saved; a 4-rank world then walks CHAIN, each layout loading the previous one's checkpoint and
saving its own at once, and this process loads the last one back. Every checkpoint holds exactly the origin's
tensors, read back whole without megazero's loader: model weights (the replicated latent projections and norms,
the split up-projections, the experts, the MTP module's, its experts split over ep too) and the fp32 master
weights and both Adam moments, bitwise.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from megazero.config import Config
from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn
from tests.helpers.moe_ckpt import KINDS, full_contents, layout_state, moe_cfg, round_trip
from tests.helpers.resume import SAVED_AT, segment

CHAIN: dict[str, dict[str, Any]] = {
    "tp2.z1": dict(tp=2, zero=1),
    "ep2.z3": dict(ep=2, zero=3),
    "tp2.ep2.z2": dict(tp=2, ep=2, zero=2),
    "cp2.ep2.z1": dict(cp=2, ep=2, zero=1),
    "pp2.z0": dict(pp=2, zero=0),
    "tp2.pp2.z3": dict(tp=2, pp=2, zero=3),
    "tp4.etp1.ep4.z1": dict(tp=4, etp=1, ep=4, zero=1),
    "cp2.tp2.z0": dict(cp=2, tp=2, zero=0),
    "ep4.z3": dict(ep=4, zero=3),
}
MTP_PARTS = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "final_norm.weight", "block.attention.kv_up.weight",
             "block.mlp.experts.fc1_weight", "block.mlp.router.weight", "block.mlp.shared_expert.fc1.weight")


def mla_cfg(**layout: Any) -> Config:
    """The MoE checkpoint tests' config at this layout, with MLA attention and one MTP module (DeepSeek-V3's)."""
    base = moe_cfg(**layout)
    model = dataclasses.replace(base.model, arch="llama", multi_latent_attention=True, q_lora_rank=16,
                                kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                                mtp_num_layers=1)
    return dataclasses.replace(base, model=model)


def world(pstate: ParallelState, ck: str) -> None:
    """Each CHAIN layout loads the previous one's checkpoint and saves its own."""
    source = f"{ck}/serial"
    for name, layout in CHAIN.items():
        cfg = mla_cfg(**layout)
        round_trip(layout_state(4, cfg), cfg, source, f"{ck}/{name}")
        source = f"{ck}/{name}"


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> str:
    ck = str(tmp_path_factory.mktemp("mla_ckpt"))
    serial = ParallelState.serial()
    segment(serial, mla_cfg(mbs=8, iters=SAVED_AT), save=f"{ck}/serial.trained")
    round_trip(serial, mla_cfg(mbs=8), f"{ck}/serial.trained", f"{ck}/serial")
    spawn(world, 4, ck)
    round_trip(serial, mla_cfg(mbs=8), f"{ck}/{list(CHAIN)[-1]}", f"{ck}/serial.end")
    return ck


def test_mla_moe_round_trips_across_layouts_are_bitwise(ck):
    origin = {k: v for k, v in full_contents(f"{ck}/serial").items() if isinstance(v, torch.Tensor)}
    assert not any(t.isnan().any() for t in origin.values())
    for part in ("q_down", "kv_norm", "kv_up", ".experts."):
        assert any(part in k for k in origin), part
    assert any(k.startswith("optim/") and "kv_down" in k for k in origin)
    for part in MTP_PARTS:  # the MTP module's weights, master weights and Adam moments are compared too
        names = (f"model/mtp.0.{part}", *(f"optim/mtp.0.{part}/{kind}" for kind in KINDS))
        assert all(k in origin for k in names), part
        assert origin[f"optim/mtp.0.{part}/exp_avg"].abs().max() > 0, part  # trained, not just initialised
    assert origin["model/mtp.0.block.mlp.router.expert_bias"].abs().max() > 0  # its expert bias moved as well
    for name in [*CHAIN, "serial.end"]:
        got = full_contents(f"{ck}/{name}")
        assert got["scalars"] == full_contents(f"{ck}/serial")["scalars"], name
        want = {**dict(tp=1, ep=1, pp=1, cp=1, zero=0), **CHAIN.get(name, {})}
        assert {k: got["layout"][k] for k in ("tp", "ep", "pp", "cp", "zero")} == \
            {k: want[k] for k in ("tp", "ep", "pp", "cp", "zero")}, name
        tensors = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
        assert tensors.keys() == origin.keys(), name
        for key, t in origin.items():
            assert torch.equal(tensors[key], t), f"{name}: {key}"
