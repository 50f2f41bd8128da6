"""The per-head maximum pre-softmax logit of the attention a step computes, for MuonClip's QK-clip.

Fused attention kernels return the output and the log-sum-exp, never the largest score, so the attention
paths that QK-clip needs (``optimizer/qk_clip.py``) call ``block_logit_max`` on exactly the (query, key)
blocks they attend: the whole causal sequence or each document (no CP, Ulysses after its all-to-all), each
ring piece (ring CP). A ``LogitMax`` sink collects the running maximum per head of this rank; paths that
hold only some heads (Ulysses' head shards) write at their heads' offset, the rest stays -inf, and the
step's max-reduce over the ranks fills it in.

Cost per call: one more QK^T product of the attended pairs (2·d FLOPs per pair, under no_grad; the
forward's own QK^T and PV are 4·d) and a temporary of at most ``_BUDGET`` fp32 scores (query rows are
taken in chunks), never the S x S matrix. Nothing is computed when no sink is given.
"""
from __future__ import annotations

import torch

_BUDGET = 1 << 22  # scores per chunk of query rows (16 MiB in fp32)


class LogitMax:
    """A running per-head maximum (fp32, -inf where no score was seen), shared by views at head offsets."""

    def __init__(self, heads: int, values: torch.Tensor | None = None) -> None:
        self.heads, self.values = heads, values

    def reset(self) -> None:
        self.values = None

    def at(self, offset: int, heads: int) -> "LogitMax":
        """A sink for ``heads`` heads starting at head ``offset`` of this one (the same storage)."""
        return _Offset(self, offset, heads)

    @torch.no_grad()
    def add(self, maxima: torch.Tensor, offset: int = 0) -> None:
        """Take the maximum with ``maxima`` [heads'] for heads ``offset`` .. ``offset + heads'``."""
        if self.values is None:
            self.values = torch.full((self.heads,), float("-inf"), dtype=torch.float32, device=maxima.device)
        part = self.values[offset:offset + maxima.numel()]
        torch.maximum(part, maxima.float(), out=part)

    def add_blocks(self, q: torch.Tensor, k: torch.Tensor, causal: bool, offset: int = 0) -> None:
        """Add the maxima of one attended block (``block_logit_max``'s arguments)."""
        self.add(block_logit_max(q, k, causal), offset)


class _Offset(LogitMax):
    """``LogitMax.at``: writes land in the parent's heads from ``offset`` on."""

    def __init__(self, parent: LogitMax, offset: int, heads: int) -> None:
        super().__init__(heads)
        self.parent, self.offset = parent, offset

    def add(self, maxima: torch.Tensor, offset: int = 0) -> None:
        self.parent.add(maxima, self.offset + offset)


@torch.no_grad()
def block_logit_max(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """Per query head, the largest q·k/sqrt(d) of a block (q [b, n, sq, d], k [b, g, sk, d], head h on kv head
    h // (n/g)), in fp32; ``causal``: query i sees keys up to i + sk - sq (the last sq of sk positions), as
    ``blocks.block_forward``. A head that sees no key gets -inf."""
    b, n, sq, d = q.shape
    g, sk = k.shape[1], k.shape[2]
    best = torch.full((n,), float("-inf"), dtype=torch.float32, device=q.device)
    if sq == 0 or sk == 0 or b == 0:
        return best
    qg = q.float().reshape(b, g, n // g, sq, d)
    kt = k.float().unsqueeze(2).transpose(-1, -2)  # [b, g, 1, d, sk]
    rows = max(1, _BUDGET // max(1, b * n * sk))
    for lo in range(0, sq, rows):
        hi = min(sq, lo + rows)
        seen = min(sk, hi + sk - sq) if causal else sk  # keys past the chunk's last query's are masked: skipped
        if seen <= 0:
            continue
        scores = torch.matmul(qg[:, :, :, lo:hi], kt[..., :seen]) * d ** -0.5  # [b, g, n/g, rows, seen]
        if causal:
            keep = torch.ones(hi - lo, seen, dtype=torch.bool, device=q.device).tril(sk - sq + lo)
            scores = scores.masked_fill(~keep, float("-inf"))
        torch.maximum(best, scores.amax(dim=(0, 3, 4)).reshape(n), out=best)
    return best


def whole_sequence_logit_max(sink: LogitMax, q: torch.Tensor, k: torch.Tensor, bounds, offset: int = 0) -> None:
    """Add the maxima of causal attention over whole sequences: at once, or per document of ``bounds``."""
    if bounds is None:
        sink.add_blocks(q, k, True, offset)
        return
    for i, cuts in enumerate(bounds):
        for s, e in zip(cuts[:-1], cuts[1:]):
            sink.add_blocks(q[i:i + 1, :, s:e], k[i:i + 1, :, s:e], True, offset)
