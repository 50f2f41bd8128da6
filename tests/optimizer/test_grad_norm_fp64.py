"""The global grad norm accumulates in fp64, so every layout agrees with torch's float64 norm.

Every layout is given the same full-model gradient G: each rank writes its TP
slice of a seeded G into its main grads (the last stage's copy of the tied
embedding gets zeros, so the embedding-group sum leaves G) and calls step(),
which reduces over DP (G/2 + G/2 is exact) and computes the norm. G spans
twelve orders of magnitude, so fp32 accumulation of its squares is off by far
more than fp32's 6e-8 rounding. The reference is ``torch.nn.utils.clip_grad_norm_``
on float64 copies of G. Tolerance 1e-9: fp64 sums of exact squares of fp32
values round at ~1e-16 per add; one fp32 rounding anywhere on the way is 6e-8.
"""
from __future__ import annotations

import zlib

import torch

from megazero.parallel.state import ParallelState
from megazero.tensor_parallel.layers import spec_of
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import build, make_cfg

ZEROS = (0, 1, 2)
TOL = 1e-9


def _full_grad(name: str, shape: torch.Size, stage: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{stage}/{name}".encode()))
    magnitude = torch.pow(10.0, torch.empty(shape).uniform_(-6, 6, generator=gen))
    return torch.randn(shape, generator=gen) * magnitude  # fp32 [full shape]


def norms(pstate: ParallelState, tp: int, pp: int) -> dict:
    """Per ZeRO stage, the norm step() reports; plus the full G this rank owns (for the reference)."""
    out: dict = {"norm": {}, "owned": []}
    for zero in ZEROS:
        cfg = make_cfg(zero=zero, tp=tp, pp=pp, hidden=64, bucket=20_000)
        model = build(pstate, cfg)
        chunks, opt = model.chunks, model.optimizer
        opt.zero_grad()
        for buf in opt.buffers:  # ZeRO 2 allocates bucket gradients on first use
            for b in buf.buckets:
                buf.bucket_grad(b)
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                dim = spec_of(p).split_dim
                shape = list(p.shape)
                if dim is not None:
                    shape[dim] *= pstate.tp
                full = _full_grad(name, torch.Size(shape), pstate.pp_rank)
                if spec_of(p).tied_role == "embedding_copy":
                    full = torch.zeros_like(full)
                mine = full if dim is None else full.chunk(pstate.tp, dim)[pstate.tp_rank]
                p.main_grad.copy_(mine)
                if zero == 0 and pstate.tp_rank == 0 and pstate.dp_rank == 0:
                    out["owned"].append(full)
        out["norm"][zero] = opt.step(0.0).grad_norm
    return out


def _reference(owned: list[torch.Tensor]) -> float:
    copies = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in owned]
    for c, g in zip(copies, owned):
        c.grad = g.double()
    return float(torch.nn.utils.clip_grad_norm_(copies, max_norm=float("inf")))


def _check(results: list[dict], tag: str) -> None:
    ref = _reference([g for r in results for g in r["owned"]])
    for rank, r in enumerate(results):
        for zero, norm in r["norm"].items():
            assert abs(norm - ref) <= TOL * ref, f"{tag} rank {rank} zero {zero}: {norm!r} vs float64 {ref!r}"


def test_serial_norm_is_float64_exact():
    _check([norms(ParallelState.serial(), 1, 1)], "serial")


def test_tp2_pp2_dp2_norm_is_float64_exact():
    _check(spawn(norms, 8, 2, 2, tp=2, pp=2), "tp2 pp2 dp2")
