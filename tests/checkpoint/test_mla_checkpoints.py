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

from megazero.config import Config
from tests.helpers.ckpt_chain import assert_every_checkpoint_is_the_origin, origin_tensors, walk_chain
from tests.helpers.moe_ckpt import KINDS, moe_cfg

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


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> str:
    return walk_chain(str(tmp_path_factory.mktemp("mla_ckpt")), CHAIN, mla_cfg)


def test_mla_moe_round_trips_across_layouts_are_bitwise(ck):
    origin = origin_tensors(ck)
    assert not any(t.isnan().any() for t in origin.values())
    for part in ("q_down", "kv_norm", "kv_up", ".experts."):
        assert any(part in k for k in origin), part
    assert any(k.startswith("optim/") and "kv_down" in k for k in origin)
    for part in MTP_PARTS:  # the MTP module's weights, master weights and Adam moments are compared too
        names = (f"model/mtp.0.{part}", *(f"optim/mtp.0.{part}/{kind}" for kind in KINDS))
        assert all(k in origin for k in names), part
        assert origin[f"optim/mtp.0.{part}/exp_avg"].abs().max() > 0, part  # trained, not just initialised
    assert origin["model/mtp.0.block.mlp.router.expert_bias"].abs().max() > 0  # its expert bias moved as well
    assert_every_checkpoint_is_the_origin(ck, CHAIN)
