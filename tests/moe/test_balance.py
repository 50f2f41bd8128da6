"""Balance losses: values and router-weight gradients against token-by-token references (fp64, 1e-12).

The expected gradient is autograd's on the reference objective routing_weights . upstream + aux_scale *
(coeff x loss): what the router must deliver without the model ever seeing the loss. The 2-rank test
splits each sequence over a seq_group of 2 (as SP/CP do) and checks that the summed gradient is the
serial one and that both ranks log the whole-sequence values.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from megazero.moe.balance import AuxLossScaler
from tests.helpers.dist import spawn
from tests.helpers.moe_routing import (make_router, reference_route, reference_seq_loss, reference_switch_loss,
                                       reference_z_loss, router_cfg, tokens)

SEQ, BATCH = 8, 3
TOKENS = SEQ * BATCH  # a flattened [s, b, h] activation: token t belongs to sequence t % b
AUX_SCALE = 0.25  # what the model would set for, e.g., 4 micro-batches

LOSSES = {
    "aux": {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.3},
    "seq_aux": {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.3},
    "z": {"moe_router_load_balancing_type": "none", "moe_z_loss_coeff": 0.05},
    "aux+z": {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.3, "moe_z_loss_coeff": 0.05},
}


def _upstream() -> torch.Tensor:
    """The gradient the experts would send back to the routing weights [T, k]."""
    return torch.randn(TOKENS, 2, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def expected(cfg, weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(gradient with losses, gradient without them, loss values) of the reference objective on all tokens."""
    w = weight.detach().clone().requires_grad_()
    experts, weights = reference_route(x, w, cfg)
    logits = x @ w.t()
    values: dict[str, torch.Tensor] = {}
    kind, score = cfg.moe_router_load_balancing_type, cfg.moe_router_score_function
    if cfg.moe_aux_loss_coeff:
        values[kind] = (reference_switch_loss(logits, experts, score) if kind == "aux_loss"
                        else reference_seq_loss(logits, experts, score, BATCH))
    if cfg.moe_z_loss_coeff:
        values["z_loss"] = reference_z_loss(logits)
    coeffs = {kind: cfg.moe_aux_loss_coeff, "z_loss": cfg.moe_z_loss_coeff}
    routed = (weights * _upstream()).sum()
    plain = torch.autograd.grad(routed, w, retain_graph=True)[0]
    total = routed + AUX_SCALE * sum(coeffs[name] * value for name, value in values.items())
    return torch.autograd.grad(total, w)[0], plain, {name: float(v.detach()) for name, v in values.items()}


def routed_grad(router, x: torch.Tensor, upstream: torch.Tensor, seq_group=None) -> torch.Tensor:
    router.aux_scale = AUX_SCALE
    (router(x, seq_group, BATCH).probs * upstream).sum().backward()
    return router.weight.grad


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_and_gradients_match_reference(name: str, score_function: str) -> None:
    cfg = router_cfg(moe_router_score_function=score_function, **LOSSES[name])
    router = make_router(cfg)
    x = tokens(TOKENS)
    grad, plain, values = expected(cfg, router.weight, x)
    got = routed_grad(router, x, _upstream())
    torch.testing.assert_close(got, grad, rtol=0, atol=1e-12)
    assert (grad - plain).abs().max() > 1e-4  # the losses move the gradient: the check above sees them
    assert {k: float(v) for k, v in router.last_losses.items()} == pytest.approx(values, rel=1e-12, abs=0)


def test_no_losses_no_values() -> None:
    router = make_router(router_cfg(moe_router_load_balancing_type="none"))
    router(tokens(TOKENS))
    assert router.last_losses == {}


def test_step_losses_average_the_micro_batches_once_each() -> None:
    """Two micro-batches, the second recomputed in backward (checkpointing): the step's mean counts each once."""
    router = make_router(router_cfg(**LOSSES["aux+z"]))
    router(tokens(TOKENS, seed=1))
    first = dict(router.last_losses)
    x = tokens(TOKENS, seed=2).requires_grad_()
    with set_checkpoint_early_stop(False):  # recompute the whole function, as a block's recompute passes the router
        checkpoint(lambda t: router(t, None, BATCH).probs, x, use_reentrant=False).sum().backward()
    second = dict(router.last_losses)
    assert first["aux_loss"] != second["aux_loss"]
    step = router.take_step_losses()
    for name in ("aux_loss", "z_loss"):
        torch.testing.assert_close(step[name], (first[name] + second[name]) / 2, rtol=0, atol=1e-15)
    assert router.take_step_losses() == {}


def test_scaler_is_identity_forward_and_feeds_the_scale_backward() -> None:
    out = torch.randn(4, dtype=torch.float64, requires_grad=True)
    src = torch.randn(3, dtype=torch.float64, requires_grad=True)
    loss = (src ** 2).sum()
    attached = AuxLossScaler.apply(out, loss, 0.5)
    assert torch.equal(attached, out)
    (attached * 3).sum().backward()
    assert torch.equal(out.grad, torch.full((4,), 3.0, dtype=torch.float64))
    torch.testing.assert_close(src.grad, 0.5 * 2 * src.detach(), rtol=0, atol=0)


def _split_sequences(pstate, cfgs: list[dict]) -> list[tuple[torch.Tensor, dict[str, float]]]:
    """Each rank routes half of every sequence (the first or last s/2 positions), seq_group = the tp group."""
    group, rank = pstate.tp_group, pstate.tp_rank
    half = slice(rank * TOKENS // 2, (rank + 1) * TOKENS // 2)
    results = []
    for moe in cfgs:
        router = make_router(router_cfg(**moe))
        grad = routed_grad(router, tokens(TOKENS)[half], _upstream()[half], group)
        results.append((grad, {k: float(v) for k, v in router.last_losses.items()}))
    return results


def test_split_sequence_gradients_sum_to_serial() -> None:
    cfgs = [dict(LOSSES["aux+z"]), dict(LOSSES["seq_aux"], moe_router_score_function="sigmoid")]
    per_rank = spawn(_split_sequences, 2, cfgs, tp=2)
    for i, moe in enumerate(cfgs):
        cfg = router_cfg(**moe)
        grad, _, values = expected(cfg, make_router(cfg).weight, tokens(TOKENS))
        torch.testing.assert_close(per_rank[0][i][0] + per_rank[1][i][0], grad, rtol=0, atol=1e-12)
        for rank in range(2):
            assert per_rank[rank][i][1] == pytest.approx(values, rel=1e-12, abs=0)
