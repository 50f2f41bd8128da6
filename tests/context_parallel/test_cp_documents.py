"""Context-parallel attention over packed documents against whole-sequence SDPA with the explicit
block-diagonal causal mask (the masked math kernel, one process).

Documents of lengths not divisible by anything straddle chunks and ranks; one layout is all tiny
documents, so most K/V blocks meet no query's document (skipped) and rows see only a few keys. One
gloo world per cp size runs p2p, a2a and (cp 4) the hybrid, fp32 and fp64, with and without GQA.
Bounds as in test_cp_attention.py: partial softmaxes merged in fp32/fp64 vs one masked pass.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero.context_parallel import CPContext, CPSplit
from megazero.context_parallel.attention import cp_attention
from megazero.context_parallel.doc_blocks import document_blocks, pairs, ring_runs
from tests.helpers.cp_groups import cp_groups
from tests.helpers.dist import spawn

S, D, HEADS = 48, 8, 4
BOUND = {torch.float32: 5e-6, torch.float64: 1e-12}
LAYOUTS = ((5, 13, 1, 11, 18), (3, 1, 1, 7, 2, 9, 25), (1,) * 20 + (2,) * 14)  # each sums to S


def bounds_of(layouts: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    out = []
    for lengths in layouts:
        cuts = [0]
        for n in lengths:
            cuts.append(cuts[-1] + n)
        out.append(tuple(cuts))
    return tuple(out)


def allowed(bounds: tuple[int, ...]) -> torch.Tensor:
    """[S, S] True where query i may see key j: same document, j <= i."""
    doc = torch.zeros(S, dtype=torch.long)
    for d, start in enumerate(bounds[1:-1]):
        doc[start:] = d + 1
    return (doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()


def _check(ctx: CPContext, dtype: torch.dtype, kv_heads: int, bounds) -> list[float]:
    """Max |error| of the output and dQ/dK/dV on this rank's tokens (inf if anything is not finite)."""
    g = torch.Generator().manual_seed(7 + kv_heads)
    b = len(bounds)
    q, k, v, dout = (torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
                     for shape in ((b, HEADS, S, D), (b, kv_heads, S, D), (b, kv_heads, S, D), (b, HEADS, S, D)))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.stack([allowed(c) for c in bounds]).unsqueeze(1)  # [b, 1, S, S]
    ref = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask, enable_gqa=kv_heads < HEADS)
    ref.backward(dout)
    take = lambda t: ctx.split.take(t, 2, ctx.rank)  # noqa: E731
    local = [take(t).detach().requires_grad_() for t in (q, k, v)]
    out = cp_attention(*local, ctx, bounds)
    out.backward(take(dout))
    got, want = [out] + [t.grad for t in local], [ref] + [t.grad for t in full]
    return [(a.double() - take(w).double()).abs().max().item() if torch.isfinite(a).all() else float("inf")
            for a, w in zip(got, want)]


def _world(pstate, cp: int) -> dict:
    rank = dist.get_rank()
    whole, a2a_group, ring_group = cp_groups(cp, 2)
    forms = {"p2p": CPContext(group=whole, rank=rank, comm_type="p2p", split=CPSplit(cp, 1), ring_group=whole),
             "a2a": CPContext(group=whole, rank=rank, comm_type="a2a", split=CPSplit(cp, cp), a2a_group=whole)}
    if cp >= 4:
        forms["a2a+p2p"] = CPContext(group=whole, rank=rank, comm_type="a2a+p2p", split=CPSplit(cp, 2),
                                     a2a_group=a2a_group, ring_group=ring_group)
    bounds = bounds_of(LAYOUTS)
    return {(name, dtype, kv): _check(ctx, dtype, kv, bounds) for name, ctx in forms.items()
            for dtype in (torch.float32, torch.float64) for kv in (HEADS, 2)}


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_document_attention_matches_masked_sdpa(cp: int) -> None:
    for rank, res in enumerate(spawn(_world, cp, cp, timeout=600)):
        for key, errs in res.items():
            assert max(errs) <= BOUND[key[1]], (rank, key, errs)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_computes_exactly_the_attended_pairs(cp: int) -> None:
    """Per ring rank, the pieces over all steps cover each allowed (query, key) pair once and nothing else;
    with tiny documents most blocks are skipped outright."""
    local, split = S // cp, CPSplit(cp, 1)
    for lengths in LAYOUTS:
        bounds = bounds_of((lengths,))
        mask = allowed(bounds[0])
        skipped = 0
        for rank in range(cp):
            per_step = [pairs(document_blocks(ring_runs(rank, cp, local), ring_runs((rank - step) % cp, cp, local),
                                              bounds)) for step in range(cp)]
            assert sum(per_step) == int(mask[split.positions(S, rank)].sum()), (lengths, rank, per_step)
            skipped += sum(1 for p in per_step if p == 0)
        assert sum(n * (n + 1) // 2 for n in lengths) == int(mask.sum())
        if lengths == LAYOUTS[2]:
            assert skipped >= cp * (cp - 1) - 1, skipped  # tiny documents: almost no block crosses ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_backward_reads_strided_rows_as_contiguous_ones(dtype):
    """A document's rows of larger tensors go to the CPU kernel uncopied: the same gradients, bitwise."""
    from megazero.context_parallel.blocks import block_backward, block_forward

    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn((2, HEADS, S, D), generator=g).to(dtype) for _ in range(4))
    rows = (slice(1, 2), slice(None), slice(5, 41))
    out, lse = block_forward(q[rows], k[rows], v[rows], True)
    held = torch.zeros_like(q)
    held[rows] = out
    strided = block_backward(dout[rows], q[rows], k[rows], v[rows], held[rows], lse, True)
    packed = block_backward(*(t[rows].contiguous() for t in (dout, q, k, v)), out.contiguous(), lse, True)
    assert all(torch.equal(a, b) for a, b in zip(strided, packed))
