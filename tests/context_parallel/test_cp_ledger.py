"""The CP ledger counts what the ring sends, with and without document masks.

One gloo world of 4 ranks: the ParallelState's cp group (a ring of 4) and two rings of 2 named "cp" on
the same ``pstate.ledger``. For each ring and layout, one ring attention call (forward, then backward)
must count, on the cp axis, exactly the bytes this formula gives, derived from the explicit
block-diagonal causal mask (not from the ring's own bookkeeping):

    hop h of rank src's K/V (h = 1 .. R-1, from rank src+h-1 to src+h): per run of src's two chunks,
        the span from the first to the last of its key rows that a query of some rank src+h .. src+R-1
        may attend to (any sample); 2 (K and V) x b x g x rows x d x 4 bytes (fp32)
    the dK/dV accumulator of src's K/V (R-1 hops, src+1 .. src+R-1 then home): the rows of hop 1

Unmasked, every hop carries all L rows but those of rank 0's K/V, whose late chunk no other rank's
query sees (half its rows travel).
Documents that never cross a chunk make the ring send nothing at all; the output stays exact.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.context_parallel import CPSplit
from megazero.context_parallel.doc_blocks import document_attention
from megazero.context_parallel.ring import ring_attention
from tests.helpers.dist import spawn

S, D, HEADS, KV_HEADS, B = 48, 8, 4, 2, 2
LAYOUTS = {  # per sample, document lengths summing to S
    "unmasked": None,
    "mixed": ((5, 13, 1, 11, 18), (3, 1, 1, 7, 2, 9, 25)),
    "tiny": ((1,) * 20 + (2,) * 14, (2,) * 24),
    "inside chunks": ((6,) * 8, (3,) * 16),  # chunks are 6 (cp 4) or 12 (cp 2) tokens: nothing crosses
}


def _bounds(layout):
    if layout is None:
        return None
    cuts = []
    for lengths in layout:
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        cuts.append(tuple(starts))
    return tuple(cuts)


def _allowed(bounds) -> torch.Tensor:
    """[S, S] True where query i may see key j in some sample (causal, same document)."""
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    if bounds is None:
        return causal
    masks = []
    for cuts in bounds:
        doc = torch.bucketize(torch.arange(S), torch.tensor(cuts[1:-1]), right=True)
        masks.append((doc[:, None] == doc[None, :]) & causal)
    return torch.stack(masks).any(0)


def _rows(src: int, receivers: list[int], cp: int, allowed: torch.Tensor) -> int:
    """Rows a hop of ``src``'s K/V carries: per run, the span of the key rows the receivers' queries use."""
    split, local = CPSplit(cp, 1), S // cp
    keys = split.positions(S, src)
    queries = torch.cat([split.positions(S, r) for r in receivers])
    used = allowed[queries][:, keys].any(0)
    total = 0
    for run in (used[:local // 2], used[local // 2:]):
        hit = run.nonzero().flatten()
        total += int(hit[-1] - hit[0] + 1) if hit.numel() else 0
    return total


def expected_bytes(rank: int, cp: int, bounds) -> tuple[int, int]:
    """(forward, backward) bytes this ring rank sends in one call, from the mask."""
    allowed, row = _allowed(bounds), 2 * B * KV_HEADS * D * 4  # [K; V] or [dK; dV] of one row, fp32
    ahead = lambda src, hop: [(src + h) % cp for h in range(hop, cp)]  # noqa: E731
    kv = sum(_rows((rank - i) % cp, ahead((rank - i) % cp, i + 1), cp, allowed) for i in range(cp - 1))
    dkv = sum(_rows((rank - i) % cp, ahead((rank - i) % cp, 1), cp, allowed) for i in range(1, cp))
    return kv * row, (kv + dkv) * row


def _one_call(pstate, group, cp: int, bounds) -> dict:
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(s, generator=g) for s in [(B, HEADS, S, D), (B, KV_HEADS, S, D),
                                                           (B, KV_HEADS, S, D), (B, HEADS, S, D)])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = document_attention(*full, bounds if bounds is not None else ((0, S),) * B)
    ref.backward(dout)
    split = CPSplit(cp, 1)
    local = [split.take(t, 2, rank).requires_grad_() for t in (q, k, v)]
    pstate.ledger.take()
    out = ring_attention(*local, group, bounds=bounds)
    forward = pstate.ledger.take()
    out.backward(split.take(dout, 2, rank))
    backward = pstate.ledger.take()
    got, want = [out] + [t.grad for t in local], [ref] + [t.grad for t in full]
    err = max((a - split.take(w, 2, rank)).abs().max().item() for a, w in zip(got, want))
    return {"forward": forward.get("send/cp", 0), "backward": backward.get("send/cp", 0),
            "other": {k: v for k, v in {**forward, **backward}.items() if k != "send/cp"}, "err": err,
            "rank": rank}


def _world(pstate) -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[dist.get_rank() // 2]
    pstate.ledger.name_group(pair, "cp")
    pstate.ledger.enabled = True
    return {(cp, name): _one_call(pstate, group, cp, _bounds(layout))
            for cp, group in ((4, pstate.cp_group), (2, pair)) for name, layout in LAYOUTS.items()}


def test_ring_ledger_counts_what_the_ring_sends():
    for res in spawn(_world, 4, cp=4, timeout=300):
        for (cp, name), got in res.items():
            bounds = _bounds(LAYOUTS[name])
            want = expected_bytes(got["rank"], cp, bounds)
            assert (got["forward"], got["backward"]) == want, (cp, name, got)
            assert not got["other"] and got["err"] < 5e-6, (cp, name, got)
            full = 2 * B * KV_HEADS * (S // cp) * D * 4  # [K; V] of all L rows
            unmasked = (cp - 1) * full - (full // 2 if got["rank"] <= cp - 2 else 0)  # one hop of rank 0's: half
            if name == "unmasked":
                assert want[0] == unmasked, (cp, want)
            elif name == "inside chunks":
                assert want == (0, 0), (cp, want)  # no document crosses a chunk: nothing travels
            else:
                assert want[0] < unmasked, (cp, name, want)
