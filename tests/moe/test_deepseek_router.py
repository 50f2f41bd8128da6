"""DeepSeek-V3 routing (issue 43): sigmoid scores, group-limited top-k, the routed scaling factor and the
score-correction bias, against transformers' ``DeepseekV3TopkRouter`` / ``DeepseekV3MoE`` (same weights, fp32).

transformers takes its top-k unsorted, so a token's k choices are compared as a set (both sides sorted by
expert id, the weights permuted with them); the combine weights within 1e-6 (a few ulps of values <= 2.5).
Its group score sums each group's best 2 experts; megazero's (Megatron's) the best k // group_topk: the
configs here keep k // group_topk = 2, as DeepSeek-V3's k 8 / 4 groups does.
"""
from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter

from megazero.config import ModelConfig
from megazero.moe.context import ExpertContext
from megazero.moe.layer import MoELayer
from megazero.moe.router import Router
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import MoERun, make_cfg, run_many, serial_records
from tests.helpers.refusals import refusal_line

H, E, K, GROUPS, KEEP, FFN, SHARED, SCALE = 16, 16, 4, 4, 2, 8, 2, 2.5
SEED = 7


def _hf_config(groups: int, keep: int) -> DeepseekV3Config:
    return DeepseekV3Config(hidden_size=H, moe_intermediate_size=FFN, n_routed_experts=E, n_shared_experts=SHARED,
                            num_experts_per_tok=K, n_group=groups, topk_group=keep, routed_scaling_factor=SCALE,
                            norm_topk_prob=True, hidden_act="silu")


def _our_config(grouped: bool, bias: bool) -> ModelConfig:
    groups = dict(moe_router_num_groups=GROUPS, moe_router_group_topk=KEEP) if grouped else {}
    return ModelConfig(arch="llama", hidden_size=H, num_attention_heads=2, num_layers=2, num_experts=E,
                       moe_router_topk=K, moe_ffn_hidden_size=FFN, moe_shared_expert_intermediate_size=FFN * SHARED,
                       moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=SCALE,
                       moe_router_enable_expert_bias=bias, **groups)


def _random(*shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def _hf_gate(grouped: bool, bias: bool, router: Router) -> DeepseekV3TopkRouter:
    """transformers' router with ``router``'s weight and bias; without groups it runs 1 group, kept."""
    gate = DeepseekV3TopkRouter(_hf_config(GROUPS, KEEP) if grouped else _hf_config(1, 1))
    with torch.no_grad():
        gate.weight.copy_(router.weight)
        if bias:
            gate.e_score_correction_bias.copy_(router.expert_bias)
    return gate


def _our_router(grouped: bool, bias: bool) -> Router:
    router = Router(_our_config(grouped, bias), 0, dtype=torch.float32)
    with torch.no_grad():
        router.weight.copy_(_random(E, H, seed=SEED))
        if bias:  # of the order of the sigmoid scores' spread, so it moves choices
            router.expert_bias.copy_(_random(E, seed=SEED + 1, std=0.1))
    return router


def _by_expert_id(experts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = experts.argsort(dim=-1)
    return experts.gather(1, order), weights.gather(1, order)


def _route(grouped: bool, bias: bool, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    router = _our_router(grouped, bias)
    routing = router(x)
    _, hf_weights, hf_experts = _hf_gate(grouped, bias, router)(x)
    return (*_by_expert_id(routing.experts, routing.probs), *_by_expert_id(hf_experts, hf_weights))


@pytest.mark.parametrize("grouped", [False, True], ids=["no-groups", "groups"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_routing_matches_transformers(grouped: bool, bias: bool) -> None:
    x = _random(256, H, seed=SEED + 2)
    experts, weights, hf_experts, hf_weights = _route(grouped, bias, x)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.full((256,), SCALE), rtol=0, atol=1e-5)  # renormalised, scaled


def test_the_groups_and_the_bias_change_the_choice() -> None:
    """Otherwise the parity above would not show they are applied: groups keep experts of at most 2 groups, and
    the bias, given to the choice only, moves choices while a choice kept keeps its bias-free weight."""
    x = _random(256, H, seed=SEED + 2)
    plain, plain_w, *_ = _route(False, False, x)
    grouped, *_ = _route(True, False, x)
    biased, biased_w, *_ = _route(False, True, x)
    assert not torch.equal(plain, grouped) and not torch.equal(plain, biased)
    assert all(len({int(e) // (E // GROUPS) for e in row}) <= KEEP for row in grouped)
    same = (plain == biased).all(dim=-1)
    assert 0 < int(same.sum()) < 256
    torch.testing.assert_close(plain_w[same], biased_w[same], rtol=0, atol=1e-6)


def test_top1_keeps_the_score_where_transformers_renormalises_to_one() -> None:
    """Megatron's rule renormalises only when k > 1, so a top-1 sigmoid router still gets a gradient;
    transformers' norm_topk_prob divides the one score by itself. Same choice, different weight (documented)."""
    cfg = ModelConfig(hidden_size=H, num_attention_heads=2, num_layers=2, num_experts=E, moe_router_topk=1,
                      moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=SCALE)
    router = Router(cfg, 0, dtype=torch.float32)
    with torch.no_grad():
        router.weight.copy_(_random(E, H, seed=SEED))
    hf_config = _hf_config(1, 1)
    hf_config.num_experts_per_tok = 1
    gate = DeepseekV3TopkRouter(hf_config)
    with torch.no_grad():
        gate.weight.copy_(router.weight)
    x = _random(64, H, seed=SEED + 2)
    routing = router(x)
    logits, hf_weights, hf_experts = gate(x)
    assert torch.equal(routing.experts, hf_experts)
    torch.testing.assert_close(hf_weights, torch.full((64, 1), SCALE), rtol=0, atol=1e-6)
    torch.testing.assert_close(routing.probs, SCALE * logits.sigmoid().gather(1, hf_experts), rtol=0, atol=1e-6)


def _copy_into(layer: MoELayer, hf: DeepseekV3MoE) -> None:
    """transformers' weights into megazero's layout: [E, 2F, H] gate;up and [E, H, F] down -> x @ w [E, H, F]."""
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        layer.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        layer.experts.gate_weight.copy_(gate.transpose(1, 2))
        layer.experts.fc1_weight.copy_(up.transpose(1, 2))
        layer.experts.fc2_weight.copy_(hf.experts.down_proj.transpose(1, 2))
        shared, ours = hf.shared_experts, layer.shared_expert
        ours.gate.weight.copy_(shared.gate_proj.weight)
        ours.fc1.weight.copy_(shared.up_proj.weight)
        ours.fc2.weight.copy_(shared.down_proj.weight)


def test_moe_layer_matches_deepseek_v3_moe() -> None:
    """One whole layer (groups, bias, scaling, shared expert): the output within 1e-6; the input's and the router's
    gradients (sums over k experts and the shared one, values up to ~3) within 1e-6 + 1e-6 relative, the experts'
    and the shared expert's weight gradients (sums over the tokens) within 5e-6 + 1e-6 relative."""
    config = _hf_config(GROUPS, KEEP)
    config._experts_implementation = "eager"  # transformers' per-expert loop, as a standalone module runs anyway
    hf = DeepseekV3MoE(config).float()
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(hf.named_parameters())):
            p.copy_(_random(*p.shape, seed=SEED + 10 + i, std=0.3))
        hf.gate.e_score_correction_bias.copy_(_random(E, seed=SEED + 1, std=0.1))
    layer = MoELayer(_our_config(True, True), ExpertContext(), 0, dtype=torch.float32)
    _copy_into(layer, hf)
    x_BSH = _random(2, 24, H, seed=SEED + 3).requires_grad_()
    x_SBH = x_BSH.detach().transpose(0, 1).contiguous().requires_grad_()
    want = hf(x_BSH)
    got = layer(x_SBH)
    torch.testing.assert_close(got.transpose(0, 1), want, rtol=0, atol=1e-6)
    probe = _random(2, 24, H, seed=SEED + 4)
    (want * probe).sum().backward()
    (got * probe.transpose(0, 1)).sum().backward()
    torch.testing.assert_close(x_SBH.grad.transpose(0, 1), x_BSH.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.router.weight.grad, hf.gate.weight.grad, rtol=1e-6, atol=1e-6)
    assert layer.router.weight.grad.abs().sum() > 0
    gate, up = hf.experts.gate_up_proj.grad.chunk(2, dim=1)
    experts, shared = layer.experts, layer.shared_expert
    for ours, theirs in [(experts.gate_weight, gate.transpose(1, 2)), (experts.fc1_weight, up.transpose(1, 2)),
                         (experts.fc2_weight, hf.experts.down_proj.grad.transpose(1, 2)),
                         (shared.gate.weight, hf.shared_experts.gate_proj.weight.grad),
                         (shared.fc1.weight, hf.shared_experts.up_proj.weight.grad),
                         (shared.fc2.weight, hf.shared_experts.down_proj.weight.grad)]:
        torch.testing.assert_close(ours.grad, theirs, rtol=1e-6, atol=5e-6)  # sums over tokens: as test_moe_layer


MOE = ["--num-experts", "8", "--moe-router-score-function", "sigmoid"]


@pytest.mark.parametrize("argv,expected", [
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups (3) must divide --num-experts (8); pick a divisor of E."),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "5", "--moe-router-topk", "6"],
     "--moe-router-group-topk (5) must not exceed --moe-router-num-groups (4); keep at most every group."),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-topk", "5"],
     "--moe-router-topk (5) exceeds the 4 experts of the --moe-router-group-topk 2 groups kept; raise "
     "--moe-router-group-topk or lower k."),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "3", "--moe-router-topk", "2"],
     "--moe-router-topk (2) below --moe-router-group-topk (3) scores every group 0"),
], ids=["groups-not-dividing-experts", "group-topk-above-groups", "topk-above-kept-experts", "topk-below-group-topk"])
def test_a_bad_group_setting_is_refused_in_one_line(argv: list[str], expected: str) -> None:
    line = refusal_line(["--config", "configs/tiny.yaml", *MOE, *argv], 1)
    assert "\n" not in line and line.startswith(f"pretrain_gpt.py: error: {expected}"), line


DEEPSEEK = dict(num_experts=8, moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=1e-2, moe_router_load_balancing_type="seq_aux_loss",
                moe_shared_expert_intermediate_size=32)
RUNS = [MoERun("deepseek.ep2", make_cfg(ep=2, iters=10, model=DEEPSEEK))]


def test_ep2_deepseek_routing_trains_as_one_process() -> None:
    """Sigmoid, groups, scaling, bias updates, sequence aux loss and a shared expert: loss and grad norm of 10
    iterations within 1e-5 relative of one process on both ranks."""
    (want,) = serial_records([run.cfg for run in RUNS])
    for rank, result in enumerate(spawn(run_many, 2, RUNS)):
        (got,) = result["deepseek.ep2"]
        assert len(got) == len(want) == 10
        for it, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), start=1):
            errs = abs(loss - ref_loss) / abs(ref_loss), abs(norm - ref_norm) / abs(ref_norm)
            assert max(errs) <= 1e-5, f"rank {rank} iteration {it}: loss {errs[0]:.1e}, grad norm {errs[1]:.1e}"
