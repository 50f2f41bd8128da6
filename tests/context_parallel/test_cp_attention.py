"""Context-parallel attention against whole-sequence causal SDPA on one process.

One gloo world per cp size (2, 4, 8) runs every check: each rank builds the same full q/k/v, the
serial reference (SDPA, same dtype), then its own tokens through ``cp_attention`` and compares output
and dQ/dK/dV on its tokens. Bounds: p2p and the hybrid 5e-6 (fp32) / 1e-12 (fp64), the merge of R
partial softmaxes in fp32 vs the serial kernel's one pass; a2a forward bitwise (the same SDPA per
head), gradients within the fp32 bound (bitwise unless kv heads were replicated). Bytes come from a
CommLedger naming the CP groups and must equal the formulas in ring.py / ulysses.py.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megazero.context_parallel import CPContext, CPSplit
from megazero.context_parallel.attention import cp_attention
from megazero.context_parallel.blocks import block_forward, math_forward, merge
from megazero.context_parallel.ring import attention_work, ring_attention
from megazero.parallel.collectives import CommLedger
from tests.helpers.cp_groups import cp_groups
from tests.helpers.dist import spawn

B, S, D, HEADS = 1, 64, 8, 8
BOUND = {torch.float32: 5e-6, torch.float64: 1e-12}


def _full(dtype: torch.dtype, kv_heads: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + kv_heads)
    shapes = [(B, HEADS, S, D), (B, kv_heads, S, D), (B, kv_heads, S, D), (B, HEADS, S, D)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]  # q, k, v, dout


def _run(ctx: CPContext, dtype: torch.dtype, kv_heads: int, attn=cp_attention) -> dict:
    """Max |error| of output and grads on this rank's tokens, and whether the output is bitwise."""
    q, k, v, dout = _full(dtype, kv_heads)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=kv_heads < HEADS)
    ref.backward(dout)
    take = lambda t: ctx.split.take(t, 2, ctx.rank)  # noqa: E731
    local = [take(t).detach().requires_grad_() for t in (q, k, v)]
    out = attn(*local, ctx)
    out.backward(take(dout))
    got, want = [out] + [t.grad for t in local], [ref] + [t.grad for t in full]
    errs = [(a.double() - take(b).double()).abs().max().item() for a, b in zip(got, want)]
    return {"err": errs, "bitwise": [torch.equal(a, take(b)) for a, b in zip(got, want)]}


def _traffic(whole, dtype: torch.dtype, kv_heads: int, comm_type: str) -> tuple[dict, dict]:
    """Bytes this rank sent on the CP group in one forward, then in one backward."""
    ledger = CommLedger()
    ledger.name_group(whole, "cp")
    ledger.enabled = True
    cp, rank = dist.get_world_size(whole), dist.get_rank(whole)
    split = CPSplit(cp, cp if comm_type == "a2a" else 1)
    ctx = CPContext(group=whole, rank=rank, comm_type=comm_type, split=split,
                    a2a_group=whole if comm_type == "a2a" else None, ring_group=whole if comm_type == "p2p" else None)
    q, k, v, dout = (split.take(t, 2, rank) for t in _full(dtype, kv_heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = cp_attention(q, k, v, ctx)
    forward = ledger.take()
    out.backward(dout)
    return forward, ledger.take()


def _world(pstate, cp: int) -> dict:
    """Every check of one cp size (a2a+p2p with U = 2 from cp 4)."""
    rank = dist.get_rank()
    whole, a2a_group, ring_group = cp_groups(cp, 2)
    res: dict = {}
    for dtype in (torch.float32, torch.float64):
        for kv in (HEADS, 2):
            p2p = CPContext(group=whole, rank=rank, comm_type="p2p", split=CPSplit(cp, 1), ring_group=whole)
            res["p2p", dtype, kv] = _run(p2p, dtype, kv)
            a2a = CPContext(group=whole, rank=rank, comm_type="a2a", split=CPSplit(cp, cp), a2a_group=whole)
            res["a2a", dtype, kv] = _run(a2a, dtype, kv)
            if cp >= 4:
                hybrid = CPContext(group=whole, rank=rank, comm_type="a2a+p2p", split=CPSplit(cp, 2),
                                   a2a_group=a2a_group, ring_group=ring_group)
                res["a2a+p2p", dtype, kv] = _run(hybrid, dtype, kv)
    math_ring = lambda q, k, v, ctx: ring_attention(q, k, v, ctx.group, force_math=True)  # noqa: E731
    res["p2p-math", torch.float64, 2] = _run(p2p, torch.float64, 2, attn=math_ring)
    for comm in ("p2p", "a2a"):
        for kv in (HEADS, 2):
            res["bytes", comm, kv] = _traffic(whole, torch.float32, kv, comm)
    return res


def _expected_bytes(comm: str, cp: int, kv: int, rank: int) -> tuple[float, float]:
    local, e = S // cp, 4  # fp32
    if comm == "p2p":
        full = 2 * B * kv * local * D * e  # [K; V] of this rank's tokens
        # rank 0's K/V travel half (no later rank sees its late chunk): the hop of them that ranks 0 .. cp-2
        # send, and the dK/dV accumulator of them that ranks 1 .. cp-1 send
        kv_hops = (cp - 1) * full - (full / 2 if rank <= cp - 2 else 0)
        dkv_hops = (cp - 1) * full - (full / 2 if rank > 0 else 0)
        return kv_hops, kv_hops + dkv_hops  # backward: K/V again, others' dK/dV home
    kv_heads = kv if kv % cp == 0 else math.lcm(kv, cp)  # replicated so each rank gets whole kv heads
    per = lambda heads: (cp - 1) / cp * B * heads * local * D * e  # noqa: E731
    four = 2 * per(HEADS) + 2 * per(kv_heads)  # q, k, v, out (backward: dout, dq, dk, dv)
    return four, four


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_attention_matches_serial_sdpa(cp: int) -> None:
    results = spawn(_world, cp, cp, timeout=600)
    for rank, res in enumerate(results):
        for key, val in res.items():
            if key[0] == "bytes":
                continue
            kind, dtype = key[0], key[1]
            bound = BOUND[dtype]
            assert max(val["err"]) <= bound, (rank, key, val["err"])
            if kind == "a2a":
                assert val["bitwise"][0], (rank, key, val["err"])  # forward: the same SDPA on each head
                if key[2] % cp == 0:  # no kv head replicated: the backward is the same SDPA's too
                    assert all(val["bitwise"]), (rank, key, val["err"])
        for comm in ("p2p", "a2a"):
            for kv in (HEADS, 2):
                forward, backward = res["bytes", comm, kv]
                kind = "send" if comm == "p2p" else "all_to_all"
                want_f, want_b = _expected_bytes(comm, cp, kv, rank)
                assert forward == {f"{kind}/cp": round(want_f)}, (rank, comm, kv, forward)
                assert backward == {f"{kind}/cp": round(want_b)}, (rank, comm, kv, backward)


def test_balanced_split_gives_every_rank_the_same_work() -> None:
    for cp in (2, 4, 8):
        local = 4096 // cp
        balanced = [attention_work(r, cp, local) for r in range(cp)]
        contiguous = [attention_work(r, cp, local, balanced=False) for r in range(cp)]
        assert len(set(balanced)) == 1
        serial = 4096 * 4097 // 2  # every unmasked score of the sequence, computed once over the ranks
        assert sum(balanced) == sum(contiguous) == serial
        mean = serial / cp
        assert max(contiguous) / mean == pytest.approx((2 * cp - 1) / cp, rel=2 / local)  # the last rank's share


def test_merge_with_a_fully_masked_block_is_nan_free() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    out_a, lse_a = block_forward(q, k, v, causal=True)
    nothing = torch.zeros(6, 6, dtype=torch.bool)
    out_b, lse_b = math_forward(q, k, v, causal=False, mask=nothing)  # a block wholly above the diagonal
    assert torch.isneginf(lse_b).all() and not out_b.isnan().any()
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    poisoned = torch.full_like(out_b, float("nan"))  # whatever a kernel left in rows that saw nothing
    out, _ = merge(out_a, lse_a, poisoned, lse_b)
    assert torch.equal(out, out_a)
    out, lse = merge(out_b, lse_b, out_b, lse_b)  # rows no block has reached yet
    assert not out.isnan().any() and (out == 0).all() and torch.isneginf(lse).all()
