"""Dispatch + grouped experts + combine match a dense reference, at ep 1, 2 and 4 and etp 1 and 2.

The reference (tests/helpers/moe.py) runs every expert on every token of the whole world with the
serial (ep 1, etp 1) weights and masks by the routing; each rank compares its outputs, the gradients
of its tokens and routing weights, and its slices of the expert-weight gradients (the world is
etp x ep, so an expert's gradient on its ep rank already holds every token's share). The stand-in
routing gives the last expert no token and the one before it exactly one. Tolerances are the
issue's: fp64 everything within 1e-12; fp32 outputs within 1e-6, gradients within 5e-6 (absolute;
outputs are O(1)). Initialisation is compared bitwise: an expert's weights do not depend on ep/etp.
The dropless all-to-all's bytes, counted at the collectives, equal the rows that leave the rank.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero.moe.context import ExpertContext
from megazero.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher, Capacity
from megazero.moe.experts import grouped_linear, grouped_mm_supported
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn
from tests.helpers.moe import (built_experts, local_slice, moe_config, reference_keep, reference_moe,
                               stand_in_routing)

TOKENS, EXPERTS, TOPK = 12, 8, 2
CASES = {"dropless": (AllToAllDispatcher, None),
         "cap-probs": (AllToAllDispatcher, Capacity(0.5, "probs")),
         "cap-position": (AllToAllDispatcher, Capacity(0.5, "position")),
         "cap-probs-pad": (AllToAllDispatcher, Capacity(0.75, "probs", pad=True)),
         "cap-position-pad": (AllToAllDispatcher, Capacity(0.75, "position", pad=True)),
         "allgather": (AllGatherDispatcher, None),
         "allgather-cap": (AllGatherDispatcher, Capacity(0.5, "probs"))}
LIMITS = {torch.float64: {"out": 1e-12, "grad": 1e-12}, torch.float32: {"out": 1e-6, "grad": 5e-6}}


def _world_inputs(world: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Every rank's (x, experts, probs, output grad): each rank makes all of them, for the reference."""
    inputs = []
    for r in range(world):
        gen = torch.Generator().manual_seed(200 + r)
        x = torch.randn(TOKENS, 16, generator=gen, dtype=torch.float64).to(dtype)
        experts_TK, probs_TK = stand_in_routing(r, TOKENS, EXPERTS, TOPK)
        inputs.append((x, experts_TK, probs_TK.detach(), torch.randn(TOKENS, 16, generator=gen).to(dtype)))
    return inputs


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _reference(serial, inputs, capacity, gated: bool) -> tuple[list, list, list, dict]:
    """Outputs, x grads and weight grads of every rank's tokens, and the full weight grads."""
    weights = {n: _leaf(p) for n, p in serial.named_parameters()}
    xs, probs = [_leaf(x) for x, *_ in inputs], [_leaf(p) for _, _, p, _ in inputs]
    outs, total = [], 0
    for x, p, (_, experts_TK, _, g) in zip(xs, probs, inputs):
        keep = reference_keep(experts_TK, p, EXPERTS, None if capacity is None else capacity.factor,
                              "probs" if capacity is None else capacity.policy)
        outs.append(reference_moe(x, p, experts_TK, keep, weights, gated))
        total = total + (outs[-1] * g).sum()
    total.backward()
    return outs, [x.grad for x in xs], [p.grad for p in probs], {n: w.grad for n, w in weights.items()}


def _dropless_ep_bytes(ctx: ExpertContext, inputs, rank: int, element_size: int) -> int:
    """What the ledger must count on the ep axis for one dropless forward + backward: rows sent off-rank (this
    rank's assignments to other ranks' experts, dispatch and its backward; the rows other ranks sent here,
    combine and its backward), plus the count exchange (E int64 less the block kept)."""
    local = EXPERTS // ctx.ep
    sent = int((inputs[rank][1] // local != ctx.ep_rank).sum())
    peers = [ctx.etp_rank + ctx.etp * e for e in range(ctx.ep) if e != ctx.ep_rank]
    received = sum(int((inputs[p][1] // local == ctx.ep_rank).sum()) for p in peers)
    counts = (EXPERTS - local) * 8 if ctx.ep > 1 else 0
    return 2 * (sent + received) * 16 * element_size + counts


def _case_errors(ctx, ledger, serial, local, inputs, case: str, gated: bool) -> dict[str, float]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    dispatcher_type, capacity = CASES[case]
    x, experts_TK, probs_TK, g = inputs[rank]
    x, probs_TK = _leaf(x), _leaf(probs_TK)
    local.zero_grad(set_to_none=True)
    ledger.enabled = True
    y = dispatcher_type(EXPERTS, ctx, capacity)(x, probs_TK, experts_TK, local)
    (y * g).sum().backward()
    ledger.enabled, sent = False, ledger.take()
    outs, dxs, dprobs, dweights = _reference(serial, inputs, capacity, gated)
    errs = {"out": (y - outs[rank]).abs().max(), "dx": (x.grad - dxs[rank]).abs().max(),
            "dprobs": (probs_TK.grad - dprobs[rank]).abs().max()}
    for name, p in local.named_parameters():
        errs[f"d{name}"] = (p.grad - local_slice(dweights[name], p)).abs().max()
    if case == "dropless":
        expected = _dropless_ep_bytes(ctx, inputs, rank, x.element_size())
        errs["traffic"] = torch.tensor(abs(sent.get("all_to_all/ep", 0) - expected))
    return {k: float(v.detach()) for k, v in errs.items()}


def check_grids(pstate, grids: list[tuple[int, int]]) -> dict[str, float]:
    """Errors per (etp, ep, arch, dtype, case, quantity) on this rank; "init" entries must be exactly 0."""
    errors = {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    for etp, ep in grids:
        grid = Layout.from_world(world, 1, 1, ep=ep, etp=etp)  # the world is etp x ep: edp = 1
        pstate = ParallelState.build(grid, "cpu") if world > 1 else ParallelState.serial()
        ctx = ExpertContext.of(pstate)
        for arch in ("llama", "gpt2"):
            cfg = moe_config(arch)
            for dtype in (torch.float64, torch.float32):
                serial, local = built_experts(cfg, ExpertContext(), dtype), built_experts(cfg, ctx, dtype)
                tag = f"etp{etp}/ep{ep}/{arch}/{str(dtype)[6:]}"
                for name, p in local.named_parameters():
                    drawn = local_slice(serial.get_parameter(name), p)
                    errors[f"{tag}/init/{name}"] = float((p - drawn).detach().abs().max())
                with torch.no_grad():  # biases start at 0: make them count
                    for name, p in serial.named_parameters():
                        if "bias" in name:
                            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(5))
                            local.get_parameter(name).copy_(local_slice(p, local.get_parameter(name)))
                inputs = _world_inputs(world, dtype)
                for case in CASES:
                    for q, v in _case_errors(ctx, pstate.ledger, serial, local, inputs, case,
                                                arch == "llama").items():
                        errors[f"{tag}/{case}/{q}"] = v
    return errors


def _assert_within(per_rank: list[dict[str, float]]) -> None:
    bad = []
    for rank, errors in enumerate(per_rank):
        for key, err in errors.items():
            dtype = torch.float64 if "/float64/" in key else torch.float32
            exact = "/init/" in key or key.endswith("/traffic")
            limit = 0.0 if exact else LIMITS[dtype]["out" if key.endswith("/out") else "grad"]
            if not err <= limit:
                bad.append(f"rank {rank} {key}: {err:.3g} > {limit:g}")
    assert not bad, "\n".join(bad)


def test_ep1_etp1_matches_dense_reference():
    _assert_within([check_grids(None, [(1, 1)])])


@pytest.mark.parametrize("world,grids", [(2, [(1, 2), (2, 1)]), (4, [(1, 4), (2, 2)])])
def test_expert_parallel_matches_dense_reference(world, grids):
    _assert_within(spawn(check_grids, world, grids))


def test_grouped_linear_takes_empty_and_single_row_experts_and_a_sum_backward():
    """The grouped GEMM (fp32) equals the fp64 per-expert loop, with experts of 0 and 1 rows, and its backward
    accepts the stride-0 gradient of ``.sum()``, also when no row at all arrived."""
    counts = [3, 0, 1, 4]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    w = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(2))
    x32, w32, x64, w64 = _leaf(x), _leaf(w), _leaf(x.double()), _leaf(w.double())
    grouped_linear(x32, w32, counts).sum().backward()
    looped = grouped_linear(x64, w64, counts)
    looped.sum().backward()
    assert (grouped_linear(x32, w32, counts).double() - looped).abs().max() < 1e-5
    assert (x32.grad.double() - x64.grad).abs().max() < 1e-5
    assert (w32.grad.double() - w64.grad).abs().max() < 1e-5
    assert w32.grad[1].abs().max() == 0
    nothing = _leaf(x[:0])  # no token reached any local expert
    grouped_linear(nothing, w32, [0, 0, 0, 0]).sum().backward()
    assert nothing.grad.shape == (0, 16)


def test_grouped_linear_in_bf16_matches_fp64_loop_and_falls_back_where_unaligned():
    """bf16 takes the grouped GEMM (within bf16 rounding of the fp64 loop); rows of 6 fp32 values (24 bytes, not a
    multiple of 16) take the loop, exactly equal to the per-expert products."""
    counts = [2, 1, 0, 5]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    w = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(4))
    exact = grouped_linear(x.double(), w.double(), counts)
    assert (grouped_linear(x.bfloat16(), w.bfloat16(), counts).double() - exact).abs().max() < 0.1
    assert grouped_mm_supported(x.bfloat16(), w.bfloat16()) and not grouped_mm_supported(x[:, :6], w[:, :6, :6])
    rows = grouped_linear(x[:, :6].contiguous(), w[:, :6, :6].contiguous(), counts)
    assert torch.equal(rows[2:3], x[2:3, :6] @ w[1, :6, :6])
