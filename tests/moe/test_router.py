"""The router's choice and weights against a token-by-token reference and transformers' routers.

Tolerances: fp64 1e-12 (same math, another order of operations); fp32 1e-6 (a few ulps of weights <= 1).
transformers' routers run their softmax in fp32 whatever the input, so they are compared in fp32.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from megazero.moe.router import Router
from tests.helpers.moe_routing import make_router, reference_route, router_cfg, tokens

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}

ROUTINGS = {
    "softmax-topk-then-softmax": {},
    "softmax-pre": {"moe_router_pre_softmax": True, "moe_router_topk": 3},
    "softmax-scaled": {"moe_router_topk_scaling_factor": 2.5},
    "sigmoid": {"moe_router_score_function": "sigmoid"},
    "sigmoid-k1": {"moe_router_score_function": "sigmoid", "moe_router_topk": 1},
    "sigmoid-groups": {"moe_router_score_function": "sigmoid", "moe_router_topk": 4, "moe_router_num_groups": 4,
                       "moe_router_group_topk": 2},
    "softmax-pre-groups": {"moe_router_pre_softmax": True, "moe_router_topk": 3, "moe_router_num_groups": 4,
                           "moe_router_group_topk": 2},
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_routing_matches_reference(name: str, dtype: torch.dtype) -> None:
    cfg = router_cfg(**ROUTINGS[name])
    router = make_router(cfg, dtype)
    x = tokens(24, dtype)
    routing = router(x)
    experts, weights = reference_route(x, router.weight.detach(), cfg)
    assert torch.equal(routing.experts, experts)
    torch.testing.assert_close(routing.probs, weights, rtol=0, atol=TOL[dtype])
    assert routing.probs.dtype == dtype
    assert torch.equal(routing.tokens_per_expert, torch.bincount(experts.flatten(), minlength=8))


def test_group_limited_routing_differs_from_plain_topk() -> None:
    """The groups must matter for the chosen tokens: otherwise the group test above proves nothing."""
    grouped = make_router(router_cfg(**ROUTINGS["sigmoid-groups"]))
    plain = make_router(router_cfg(moe_router_score_function="sigmoid", moe_router_topk=4))
    x = tokens(24)
    assert not torch.equal(grouped(x).experts, plain(x).experts)
    assert all(len({int(e) // 2 for e in row}) <= 2 for row in grouped(x).experts)  # experts of at most 2 groups


def test_bf16_input_routes_in_fp32() -> None:
    router = make_router(router_cfg(), torch.bfloat16)
    routing = router(tokens(8, torch.bfloat16))
    assert routing.probs.dtype == torch.float32
    experts, weights = reference_route(tokens(8, torch.bfloat16).float(), router.weight.detach().float(),
                                       router_cfg())
    assert torch.equal(routing.experts, experts)
    torch.testing.assert_close(routing.probs, weights, rtol=0, atol=1e-6)


def _hf_gate(family: str, norm_topk_prob: bool, weight: torch.Tensor) -> torch.nn.Module:
    if family == "mixtral":
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
        gate = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2))
    else:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
        gate = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2,
                                                 norm_topk_prob=norm_topk_prob))
    with torch.no_grad():
        gate.weight.copy_(weight)
    return gate


@pytest.mark.parametrize("family,norm_topk_prob", [("mixtral", True), ("qwen3", True), ("qwen3", False)])
def test_matches_transformers_router(family: str, norm_topk_prob: bool) -> None:
    """Mixtral and Qwen3 with norm_topk_prob renormalise the top-k (our default); Qwen3 without it is pre-softmax."""
    router = make_router(router_cfg(moe_router_pre_softmax=not norm_topk_prob), torch.float32)
    gate = _hf_gate(family, norm_topk_prob, router.weight.detach())
    x = tokens(64, torch.float32)
    routing = router(x)
    _, hf_weights, hf_experts = gate(x)
    assert torch.equal(routing.experts, hf_experts)
    torch.testing.assert_close(routing.probs, hf_weights, rtol=0, atol=1e-7)


def test_expert_bias_changes_the_choice_not_the_weights() -> None:
    cfg = router_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    router = make_router(cfg)
    x = tokens(24)
    unbiased = router(x)
    router.expert_bias[5] = 10.0  # expert 5 wins every token's first slot
    biased = router(x)
    assert (biased.experts[:, 0] == 5).all() and not torch.equal(biased.experts, unbiased.experts)
    experts, weights = reference_route(x, router.weight.detach(), cfg, router.expert_bias)
    assert torch.equal(biased.experts, experts)
    torch.testing.assert_close(biased.probs, weights, rtol=0, atol=1e-12)  # weights from the bias-free scores
    assert "expert_bias" in router.state_dict() and router.expert_bias.dtype == torch.float32


def test_no_expert_bias_buffer_without_the_flag() -> None:
    assert "expert_bias" not in make_router(router_cfg()).state_dict()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_force_balance_spreads_tokens_exactly(score_function: str) -> None:
    cfg = router_cfg(moe_router_force_balance=True, moe_router_topk=3, moe_router_score_function=score_function)
    router = make_router(cfg)
    x = tokens(16)  # 16 tokens x 3 choices = 48 = 6 per expert
    routing = router(x)
    assert torch.equal(routing.tokens_per_expert, torch.full((8,), 6))
    assert all(len(set(row.tolist())) == 3 for row in routing.experts)
    from tests.helpers.moe_routing import reference_weights
    logits = x @ router.weight.detach().t()
    expected = torch.stack([reference_weights(logits[t], routing.experts[t].tolist(), cfg) for t in range(16)])
    torch.testing.assert_close(routing.probs, expected, rtol=0, atol=1e-12)
    (routing.probs * torch.randn(16, 3, dtype=torch.float64)).sum().backward()
    assert router.weight.grad.abs().sum() > 0


def test_step_counts_skip_recompute_and_eval() -> None:
    """A recomputed forward (activation checkpointing, in backward) routes the same tokens: counted once."""
    router = make_router(router_cfg())
    x = tokens(24).requires_grad_()
    with set_checkpoint_early_stop(False):  # recompute the whole function, as a block's recompute passes the router
        checkpoint(lambda t: router(t).probs, x, use_reentrant=False).sum().backward()
    once = router(x.detach()).tokens_per_expert
    assert torch.equal(router.take_step_tokens_per_expert(), 2 * once)
    assert torch.equal(router.take_step_tokens_per_expert(), torch.zeros(8, dtype=torch.int64))
    router.eval()
    router(x.detach())
    assert torch.equal(router.take_step_tokens_per_expert(), torch.zeros(8, dtype=torch.int64))


def test_update_expert_bias_moves_towards_balance() -> None:
    router = make_router(router_cfg(moe_router_enable_expert_bias=True))
    router.update_expert_bias(torch.tensor([10, 2, 4, 4, 4, 4, 6, 6]), rate=0.5)  # mean 5
    assert router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5, 0.5, 0.5, -0.5, -0.5]


def test_aux_loss_free_balancing_evens_a_skewed_router() -> None:
    """Routing fixed tokens through a router skewed towards expert 0, the bias updates alone even the load."""
    router = make_router(router_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True))
    skew = tokens(1)[0]
    with torch.no_grad():
        router.weight.mul_(0.1)
        router.weight[0] += 0.2 * skew
    x = tokens(512, seed=3) + skew

    def imbalance(counts: torch.Tensor) -> float:
        return float(counts.max() / counts.float().mean() - 1)

    start = imbalance(router(x).tokens_per_expert)
    for _ in range(100):
        router(x)
        router.update_expert_bias(router.take_step_tokens_per_expert(), rate=0.003)
    assert start > 2 and imbalance(router(x).tokens_per_expert) <= 0.15


def test_parameter_spec_and_init() -> None:
    router = Router(router_cfg(), 3, sequence_parallel=True)
    spec = router.weight.spec
    assert spec.split_dim is None and spec.sequence_parallel and not spec.expert
    assert spec.init_std == router_cfg().init_method_std and router.weight.shape == (8, 16)
