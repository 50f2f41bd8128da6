"""MoELayer (router -> dispatch -> experts -> combine, plus a shared expert) matches a dense reference.

Four ranks hold a tp x dp grid and, folded over it, the expert grid etp x ep x edp; each layout below
builds its groups with ``ParallelState`` (Megatron's folding). The reference runs, in one process,
the serial layer's router on every sequence, every expert on every token (masked by the routing and,
with a capacity, by a per-rank drop rule written in tests/helpers/moe.py) and the shared expert, all
with the serial (tp = ep = etp = 1) weights. Each rank compares its output, its input gradient and,
after the reductions the gradient engine performs (expert weights over edp; the rest over dp x cp,
and over tp where a weight sees only this rank's tokens), its slice of every weight gradient.
Tolerances are the issue's: fp64 within 1e-12; fp32 outputs within 1e-6, gradients within 5e-6.
"""
from __future__ import annotations

import pytest
import torch

from megazero.moe.context import ExpertContext
from megazero.moe.layer import MoELayer
from megazero.parallel import collectives as C
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.tensor_parallel.layers import initialize_parameters, spec_of
from tests.helpers.dist import spawn
from tests.helpers.moe import SEED, local_slice, moe_config, reference_keep, reference_moe, shared_reference

S, B, H, WORLD = 8, 2, 16, 4
LIMITS = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-6, 5e-6)}  # (outputs, gradients)
CAP_PAD = dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)
CAP_POSITION = dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position")
LAYOUTS = {  # name: (tp, ep, etp, dispatcher, arch, MoE settings); sequence parallel wherever tp > 1
    "ep1": (1, 1, 1, "alltoall", "llama", {}),
    "ep4": (1, 4, 1, "alltoall", "gpt2", {}),
    "ep2-etp2-capacity-pad": (1, 2, 2, "alltoall", "llama", CAP_PAD),
    "tp2-sp-ep2": (2, 2, 1, "alltoall", "gpt2", {}),
    "tp2-sp-ep4": (2, 4, 1, "alltoall", "llama", {}),
    "tp2-sp-ep2-etp2-allgather": (2, 2, 2, "allgather", "gpt2", {}),
    "tp2-sp-ep2-etp2-capacity-position": (2, 2, 2, "alltoall", "gpt2", CAP_POSITION),
}


def _slice(full: torch.Tensor, param: torch.Tensor, pstate: ParallelState) -> torch.Tensor:
    """This rank's part of a serial tensor, as ``param`` is placed (experts by spec, TP splits by tp rank)."""
    spec = spec_of(param)
    if spec.expert:
        return local_slice(full, param)
    return full if spec.split_dim is None else full.chunk(pstate.tp, spec.split_dim)[pstate.tp_rank]


def _built(cfg, ctx, pstate, dtype) -> tuple[MoELayer, MoELayer]:
    """The serial layer and this rank's, from one seed; biases made nonzero the same way in both."""
    serial, layer = MoELayer(cfg, ExpertContext(), 0, dtype=dtype), MoELayer(cfg, ctx, 0, dtype=dtype)
    initialize_parameters(serial, SEED, None)
    initialize_parameters(layer, SEED, pstate.tp_group)
    with torch.no_grad():
        for name, p in serial.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(5))
                layer.get_parameter(name).copy_(_slice(p, layer.get_parameter(name), pstate))
    return serial, layer


def _reference(serial: MoELayer, xs, gs, chunks: int) -> list[torch.Tensor]:
    """Every dp rank's output; the serial layer's parameters get the whole batch's gradients."""
    cfg, gated, total, outs = serial.router.cfg, serial.experts.gated, 0, []
    weights = dict(serial.experts.named_parameters())
    for x, g in zip(xs, gs):
        x_TH = x.reshape(S * B, H)
        routing = serial.router(x_TH)
        keep = torch.cat([reference_keep(e, p, cfg.num_experts, cfg.moe_expert_capacity_factor,
                                         cfg.moe_token_drop_policy)
                          for e, p in zip(routing.experts.chunk(chunks), routing.probs.chunk(chunks))])
        routed = reference_moe(x_TH, routing.probs, routing.experts, keep, weights, gated)
        outs.append(routed.view(S, B, H) + shared_reference(x, dict(serial.shared_expert.named_parameters()), gated))
        total = total + (outs[-1] * g).sum()
    total.backward()
    return outs


def _reduced_grad(param: torch.Tensor, pstate: ParallelState) -> torch.Tensor:
    """The gradient after the engine's sums: expert weights over edp; others over dp x cp, SP-marked also tp."""
    grad = param.grad.clone()
    spec = spec_of(param)
    groups = [pstate.edp_group] if spec.expert else [pstate.dp_cp_group] + (
        [pstate.tp_group] if spec.sequence_parallel else [])
    for group in groups:
        C.all_reduce(grad, group)
    return grad


def _layout_errors(name: str, pstate: ParallelState, dtype: torch.dtype) -> dict[str, float]:
    tp, _, _, dispatcher, arch, moe = LAYOUTS[name]
    cfg = moe_config(arch, moe_shared_expert_intermediate_size=16, **moe)
    serial, layer = _built(cfg, ExpertContext.of(pstate, tp > 1, dispatcher), pstate, dtype)
    gen = torch.Generator().manual_seed(300)
    xs = [torch.randn(S, B, H, generator=gen, dtype=torch.float64).to(dtype) for _ in range(pstate.dp)]
    gs = [torch.randn(S, B, H, generator=gen, dtype=torch.float64).to(dtype) for _ in range(pstate.dp)]
    xs_ref = [x.clone().requires_grad_() for x in xs]
    outs = _reference(serial, xs_ref, gs, tp)
    def mine(t: torch.Tensor) -> torch.Tensor:  # this rank's part of a dp rank's [s, b, h] (SP: its chunk of s)
        return t.chunk(tp)[pstate.tp_rank]

    x = mine(xs[pstate.dp_rank]).clone().requires_grad_()
    y = layer(x)
    (y * mine(gs[pstate.dp_rank])).sum().backward()
    errs = {"out": (y - mine(outs[pstate.dp_rank])).abs().max(),
            "dx": (x.grad - mine(xs_ref[pstate.dp_rank].grad)).abs().max()}
    for pname, p in layer.named_parameters():
        errs[f"d{pname}"] = (_reduced_grad(p, pstate) - _slice(serial.get_parameter(pname).grad, p, pstate)).abs().max()
    return {k: float(v.detach()) for k, v in errs.items()}


def check_layouts(_pstate) -> dict[str, float]:
    errors = {}
    for name, (tp, ep, etp, *_) in LAYOUTS.items():
        pstate = ParallelState.build(Layout.from_world(WORLD, tp, 1, ep=ep, etp=etp), "cpu")
        for dtype in (torch.float64, torch.float32):
            for quantity, err in _layout_errors(name, pstate, dtype).items():
                errors[f"{name}/{str(dtype)[6:]}/{quantity}"] = err
    return errors


def test_moe_layer_matches_dense_reference_across_layouts():
    bad = []
    for rank, errors in enumerate(spawn(check_layouts, WORLD)):
        assert len(errors) > 10 * len(LAYOUTS)
        for key, err in errors.items():
            out_limit, grad_limit = LIMITS[torch.float64 if "/float64/" in key else torch.float32]
            limit = out_limit if key.endswith("/out") else grad_limit
            if not err <= limit:
                bad.append(f"rank {rank} {key}: {err:.3g} > {limit:g}")
    assert not bad, "\n".join(bad)


def test_padding_to_capacity_with_the_allgather_dispatcher_is_refused():
    cfg = moe_config("llama", moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    with pytest.raises(ValueError, match="--moe-pad-expert-input-to-capacity needs --moe-token-dispatcher-type"):
        MoELayer(cfg, ExpertContext(dispatcher="allgather"), 0)
