"""MuonClip's QK-clip (Kimi K2): after a step, scale down the query and key weights of every head whose largest
pre-softmax logit in the step exceeded ``tau`` (``--qk-clip-threshold``), so that it would have been ``tau``.

**The maxima.** Each ``Attention`` or ``MLA`` gets a ``LogitMax`` sink (``context_parallel/logit_max.py``): the
one attention core (``model/sdpa.py``; traced into the compiled block under --compile) adds, per head of this
rank, the largest q·k/sqrt(d) over the pairs it attends (causal, within documents), in every training forward
of the step. ``clip`` puts every rank's rows into one [layers, heads] matrix
(global layer index, global head = tp rank x heads per rank + local head; -inf elsewhere) and takes its
max over the world group: that is the max over data-parallel and CP ranks (the same heads, other tokens),
and fills in the other TP ranks' heads and pipeline stages' layers, so every rank holds the whole matrix
and computes the same factors and count. 4·L·H bytes, once per step.

**The rule.** gamma = tau / max for a head over tau, else 1. Query head h's rows (weight and bias) scale by
gamma_h^alpha; the key rows of its group by min over the group's heads of gamma^(1 - alpha) (GQA shares one
key among r query heads; with r = 1 that is Kimi's per-head rule). Every head's logits then scale by
gamma_h^alpha x gamma_min^(1 - alpha) <= gamma_h: the group's worst head lands on tau exactly, the others at
or below it, and no weight is ever scaled up. Values are untouched. RoPE rotates q and k after the
projection, linearly, so it commutes with the scaling: the bound is exact with RoPE too. A per-head
RMSNorm (--qk-layernorm) would divide the scaling out, so the config refuses the pair.

**MLA** (``model/mla.py``). Head h's logit is c x (q_nope_h . k_nope_h + q_rope_h . k_rope), c the softmax scale:
q_nope_h and q_rope_h are q_up's (q_proj's) rows of head h (its dq no-position rows, then its dr RoPE rows) times
q_norm(q_down x); k_nope_h is kv_up's dq key rows of head h times kv_norm(c_kv); k_rope is ONE key from kv_down,
shared by every head. Scaling q_nope_h's rows by gamma^alpha, k_nope_h's by gamma^(1 - alpha) and q_rope_h's by
gamma scales both terms, so the whole logit, by gamma exactly (RoPE is linear; the norms sit before the
up-projections): head h lands on tau. The shared RoPE key, kv_down, the latent norms and kv_up's value rows are
left alone: scaling the shared key would move every head's logits, so its part is scaled through the query's
RoPE rows by the full gamma. Every MLA head has its own key, so the rule is per head (no group minimum).

**Where.** The fused qkv weight holds group j's rows as [its r query heads, key, value] x d
(``model/transformer.py``); each TP rank holds whole groups. The optimizer's fp32 master shard is the
source of truth: ``clip`` runs inside ``DistributedOptimizer.step`` after the update and before the
parameter gather (``after_update``), scales each master segment of a qkv parameter elementwise by its rows'
factors, and writes the shard back to the working parameter as the step does, so the gather, the next
forward and a checkpoint all see the clipped weights. A skipped step clips nothing.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config
from ..context_parallel.logit_max import LogitMax
from ..model.chunk import blocks_of
from ..model.mla import MLA
from ..model.transformer import Attention
from ..parallel import collectives as C
from ..parallel.state import ParallelState


def head_gamma(max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """Per head gamma = tau / max for heads over tau, else 1 (fp64)."""
    return torch.where(max_logits > tau, tau / max_logits.double(), torch.ones_like(max_logits, dtype=torch.float64))


def head_factors(max_logits: torch.Tensor, tau: float, alpha: float,
                 heads_per_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query factors [n], key factors [n / heads_per_group]) for heads whose max logits are ``max_logits``."""
    gamma = head_gamma(max_logits, tau)
    query = gamma ** alpha
    key = gamma.view(-1, heads_per_group).amin(dim=1) ** (1 - alpha)
    return query, key


def row_factors(query: torch.Tensor, key: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per row of the fused (grouped) qkv weight: [group: r query heads, key, value] x head_dim, flattened."""
    groups, r = key.numel(), query.numel() // key.numel()
    rows = torch.ones(groups, r + 2, head_dim, dtype=torch.float64)
    rows[:, :r] = query.view(groups, r, 1)
    rows[:, r] = key.view(groups, 1)
    return rows.reshape(-1)


def mla_row_factors(gamma: torch.Tensor, alpha: float, dq: int, dr: int,
                    dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of MLA's q_up (q_proj), [head: dq no-position, dr RoPE], and kv_up, [head: dq key, dv value], for
    heads with these gammas: gamma^alpha, gamma; gamma^(1 - alpha), 1 (the module docstring's rule)."""
    n = gamma.numel()
    query = torch.empty(n, dq + dr, dtype=torch.float64)
    query[:, :dq], query[:, dq:] = (gamma ** alpha)[:, None], gamma[:, None]
    kv = torch.ones(n, dq + dv, dtype=torch.float64)
    kv[:, :dq] = (gamma ** (1 - alpha))[:, None]
    return query.reshape(-1), kv.reshape(-1)


def layer_factors(attention: "Attention | MLA", local: torch.Tensor, tau: float, alpha: float,
                  head_dim: int) -> dict[nn.Parameter, tuple[torch.Tensor, int]]:
    """param -> (per-row factors, elements per row) of one layer's query/key parameters on this rank, whose heads'
    max logits are ``local``: the fused qkv weight and bias, or MLA's q_up (q_proj) and kv_up weights."""
    if isinstance(attention, MLA):
        query, kv = mla_row_factors(head_gamma(local, tau), alpha, attention.dq, attention.dr, attention.dv)
        q_linear = attention.q_up if attention.cfg.q_lora_rank is not None else attention.q_proj
        pairs = [(q_linear.weight, query), (attention.kv_up.weight, kv)]
    else:
        rows = row_factors(*head_factors(local, tau, alpha, attention.heads_per_group), head_dim)
        pairs = [(param, rows) for param in attention.qkv.parameters()]
    return {param: (rows, param[0].numel() if param.dim() > 1 else 1) for param, rows in pairs}


class QKClip:
    """The step's max logits of ``chunks``' attention, reduced, and the clip of their qkv weights (module doc)."""

    def __init__(self, cfg: Config, pstate: ParallelState, chunks: list[nn.Module], optimizer: Any) -> None:
        assert cfg.optimizer.qk_clip_threshold is not None, "QKClip needs --qk-clip-threshold"
        self.tau, self.alpha = cfg.optimizer.qk_clip_threshold, cfg.optimizer.qk_clip_alpha
        self.model_cfg, self.pstate, self.optimizer = cfg.model, pstate, optimizer
        self.layers: list[Attention | MLA] = []
        for block in (b for chunk in chunks for b in blocks_of(chunk)):
            if not isinstance(block.attention, (Attention, MLA)):
                raise ValueError(f"--qk-clip-threshold needs megazero's Attention or MLA in every layer; layer "
                                 f"{block.layer_id} has {type(block.attention).__name__}; drop --qk-clip-threshold.")
            self.layers.append(block.attention)
        self.local_heads = cfg.model.num_attention_heads // pstate.tp
        self.sinks = [LogitMax(self.local_heads) for _ in self.layers]
        for attention, sink in zip(self.layers, self.sinks):
            attention.logit_max = sink
        self.max_logits: torch.Tensor | None = None  # [layers, heads] of the last step clipped (None: skipped)
        self.clipped = 0
        optimizer.after_update = self.clip

    def start_step(self) -> None:
        """Forget the last step's maxima (an evaluation in between collects none: its modules are in eval)."""
        for sink in self.sinks:
            sink.reset()
        self.max_logits, self.clipped = None, 0

    def reduced_max_logits(self) -> torch.Tensor:
        """The [layers, heads] max logits over every rank (a MAX all-reduce over the world group)."""
        cfg = self.model_cfg
        table = torch.full((cfg.num_layers, cfg.num_attention_heads), float("-inf"), dtype=torch.float32,
                           device=self.pstate.device)
        first = self.pstate.tp_rank * self.local_heads
        for attention, sink in zip(self.layers, self.sinks):
            values = sink.values
            if values is not None:
                table[attention.layer_id, first:first + self.local_heads] = values
        if self.pstate.world_group is not None:
            C.all_reduce(table, self.pstate.world_group, op=dist.ReduceOp.MAX)
        return table

    @torch.no_grad()
    def clip(self) -> None:
        """Reduce the maxima and scale the qkv rows of the heads over tau in the master shards and parameters."""
        table = self.reduced_max_logits()
        self.max_logits, self.clipped = table.cpu(), int((table > self.tau).sum())
        if not self.clipped:
            return
        first = self.pstate.tp_rank * self.local_heads
        factors: dict[nn.Parameter, tuple[torch.Tensor, int]] = {}  # param -> (row factors, columns per row)
        for attention in self.layers:
            local = table[attention.layer_id, first:first + self.local_heads].cpu()
            if not bool((local > self.tau).any()):
                continue
            factors.update(layer_factors(attention, local, self.tau, self.alpha, self.model_cfg.head_dim))
        scale_master_shards(self.optimizer, factors)

    def fields(self) -> dict[str, Any]:
        """The metrics-file fields: per layer its heads' max logit (None on a skipped step), and the heads clipped."""
        if self.max_logits is None:
            return {"max_logit": None, "qk_clip_count": 0}
        per_layer = [float(v) for v in self.max_logits.amax(dim=1)]  # a layer no rank ran (none in training): None
        return {"max_logit": [v if math.isfinite(v) else None for v in per_layer], "qk_clip_count": self.clipped}


def scale_master_shards(optimizer: Any, factors: dict[nn.Parameter, tuple[torch.Tensor, int]]) -> None:
    """Multiply each listed parameter's elements, in this rank's master shard pieces, by their row's factor
    (``factors``: param -> (per-row factors, elements per row)); then store the touched shards into the
    parameters as the step does (a separate master is cast into the working copy). Offloaded masters are scaled
    where they live: host memory (``--offload-optimizer cpu``: the sweep's views) or the disk tier's file (the
    sweep streams every piece in and back out: one more pass over the state file on a step that clips). On CUDA
    the step's copies up still read the host masters: they finish first, and the touched ones go up again."""
    store, transfers = optimizer.store, optimizer.transfers
    if transfers is not None:
        transfers.up.synchronize()
    for i, lo, views in store.sweep():
        master = views[0]
        buf, bucket = optimizer.bucket_list[i]
        hi = lo + master.numel()
        touched = False
        for seg in bucket.segments:
            if seg.param not in factors or seg.hi <= lo or seg.lo >= hi:
                continue
            a, b = max(seg.lo, lo), min(seg.hi, hi)
            rows, cols = factors[seg.param]
            scale_rows(master[a - lo:b - lo], seg.param_lo + a - seg.lo, rows, cols)
            touched = True
        if touched and transfers is not None:
            transfers.send_param(buf, bucket, master, lo)
        elif touched and store.separate_master:
            buf.set_param_shard(bucket, master, lo)


def scale_rows(piece: torch.Tensor, first: int, rows: torch.Tensor, cols: int) -> None:
    """``piece`` (flat elements ``first`` .. of a row-major [rows, cols] tensor) *= its rows' factors, in place:
    the partial first row, the whole rows as one [k, cols] view, the partial last row (no index tensor)."""
    factor = rows.to(device=piece.device, dtype=piece.dtype)
    at, end = first, first + piece.numel()
    while at < end:
        row, col = divmod(at, cols)
        if col == 0 and end - at >= cols:
            whole = (end - at) // cols
            piece[at - first:at - first + whole * cols].view(whole, cols).mul_(factor[row:row + whole, None])
            at += whole * cols
        else:
            stop = min(end, (row + 1) * cols)
            piece[at - first:stop - first].mul_(factor[row])
            at = stop


def qk_clip_step(cfg: Config, pstate: ParallelState, chunks: list[nn.Module], optimizer: Any) -> "QKClip | NoClip":
    """The trainer's QK-clip: ``QKClip`` with --qk-clip-threshold, else an object that does nothing."""
    if cfg.optimizer.qk_clip_threshold is None:
        return NoClip()
    return QKClip(cfg, pstate, chunks, optimizer)


class NoClip:
    """QK-clip off: nothing collected, nothing logged."""

    max_logits, clipped = None, 0

    def start_step(self) -> None:
        pass

    def fields(self) -> dict[str, Any]:
        return {}

