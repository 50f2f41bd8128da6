"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, Moonlight), ``--multi-latent-attention``.

Legend: s sequence, b batch, h hidden, n heads (n/tp on a rank), dq = --qk-head-dim (the no-position part
of a query/key head), dr = --qk-pos-emb-head-dim (its decoupled RoPE part), dv = --v-head-dim, rq =
--q-lora-rank, rkv = --kv-lora-rank. Activations [s, b, h] ([s/tp, b, h] with sequence parallelism).

    queries   x -> q_down [rq] -> q_norm -> q_up [n (dq + dr)]     (no --q-lora-rank: q_proj [n (dq + dr)])
              each head split into q_nope [dq] and q_rope [dr] -> RoPE
    latent    x -> kv_down [rkv + dr] -> c_kv [rkv], k_rope [dr] (ONE RoPE key for all heads) -> RoPE
              kv_norm(c_kv) -> kv_up [n (dq + dv)] -> per head k_nope [dq], v [dv]
    keys      [k_nope, k_rope] per head; queries [q_nope, q_rope]: width dq + dr; values dv
    core      softmax(q k^T / sqrt(dq + dr) x YaRN's correction) v, causal (per document with --reset-attention-mask)
    output    [n dv] -> proj [h]

Each up-projection's output is laid out head by head ([q_nope, q_rope] per head; [k_nope, v] per head), as
HF's ``DeepseekV3Attention``, so a contiguous TP slice holds whole heads.

Tensor parallelism: the heads split, so q_up / q_proj and kv_up are column-parallel and proj row-parallel; the
down-projections and the latent norms are replicated (``split_dim`` None: the grad norm counts them on TP rank 0
only). Without SP they see the whole sequence and the up-projections' backward all-reduces their input gradient,
so every rank's replicated gradient is already the full one. With SP they run on this rank's sequence shard and
the up-projections gather the normalised latents (the gather is of rkv features, not h), so their gradients are
partial sums over the shards: marked ``sequence_parallel`` as SP norms are, the engine sums them over TP. The RoPE
key bypasses the up-projections: ``shared_rope_key`` gathers it under SP and sums its gradient over the heads'
ranks (reduce-scatter with SP, all-reduce without).

The core takes q, k, v of one width: v is zero-padded to dq + dr (or q, k to dv when dv is wider) and the output
cut back, so the fused kernels that need equal widths (CPU's and CUDA's flash, the per-document kernel) run, and
the softmax scale is folded into q (the kernels scale by 1/sqrt(width)). The same padded q, k, v go through
``context_parallel.cp_attention`` under --cp (ring, all-to-all, hybrid; documents), as plain attention's do.

Decoding (``decode``, a ``kv_cache.LatentKVCache``) caches per token and layer kv_norm(c_kv) [rkv] and the
RoPE'd k_rope [dr], and absorbs kv_up into the query (its key rows) and the output (its value rows), so the
per-head keys and values are never built. Not built yet (refused where a run is configured): HF conversion.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..config import ModelConfig
from ..context_parallel.doc_blocks import Bounds
from ..context_parallel.logit_max import LogitMax
from ..parallel.state import group_size
from ..tensor_parallel.comm import all_gather_first_dim, all_reduce_in_place, reduce_scatter_first_dim
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_init_std, set_spec
from .documents import Documents
from .kv_cache import KVCache, LatentKVCache, cached_attention
from .recompute import checkpointed_core
from .rope import apply_rotary, rotary_cos_sin, softmax_scale_correction
from .sdpa import core_attention


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every TP rank (MLA's down-projections); no bias (DeepSeek has none)."""

    def __init__(self, in_features: int, out_features: int, *, sequence_parallel: bool, init_std: float) -> None:
        super().__init__()
        self.weight = set_spec(nn.Parameter(torch.empty(out_features, in_features)), init_std=init_std,
                               sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def latent_norm(width: int, cfg: ModelConfig, sequence_parallel: bool) -> nn.RMSNorm:
    """RMSNorm of a latent (replicated; SP-partial gradients under sequence parallelism, as ``make_norm``)."""
    eps = cfg.norm_epsilon if cfg.mla_latent_norm_epsilon is None else cfg.mla_latent_norm_epsilon
    norm = nn.RMSNorm(width, eps=eps)
    set_spec(norm.weight, sequence_parallel=sequence_parallel, init_value=1.0)
    return norm


class _SharedRopeKey(torch.autograd.Function):
    """The RoPE key every head of every TP rank reads. Forward: all-gather the sequence (SP) or a copy.
    Backward: each rank's heads give a partial gradient: reduce-scatter (SP) or all-reduce it."""

    @staticmethod
    def forward(ctx: Any, k: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        return all_gather_first_dim(k, group).wait() if sequence_parallel else k.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.sequence_parallel:
            return reduce_scatter_first_dim(grad, ctx.group).wait(), None, None
        return all_reduce_in_place(grad.contiguous().clone(), ctx.group).wait(), None, None


def shared_rope_key(k_sbd: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """This rank's RoPE key [s(/tp), b, dr] as the whole sequence's [s, b, dr], its gradient summed over TP."""
    return k_sbd if group_size(group) == 1 else _SharedRopeKey.apply(k_sbd, group, sequence_parallel)


_EAGER_ATTEND: dict[str, Callable] = {}  # --compile: MLA.attend as a graph break, made when a block is compiled


class MLA(nn.Module):
    """Multi-head latent attention: the block's attention when ``cfg.multi_latent_attention`` (module docstring)."""

    def __init__(self, cfg: ModelConfig, ctx: Any, layer_id: int = 0) -> None:
        """``ctx``: the block's ``transformer.TPContext`` (not imported: transformer.py imports this module)."""
        super().__init__()
        self.cfg, self.ctx, self.layer_id = cfg, ctx, layer_id
        self.dq, self.dr, self.dv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        n, h, sp = cfg.num_attention_heads, cfg.hidden_size, ctx.sequence_parallel
        self.local_heads = n // group_size(ctx.group)
        column = dict(tp_group=ctx.group, bias=False, sequence_parallel=sp, init_std=cfg.init_method_std)
        query_features = n * (self.dq + self.dr)
        if cfg.q_lora_rank is not None:  # registration order = memory.params.mla_param_numels
            self.q_down = ReplicatedLinear(h, cfg.q_lora_rank, sequence_parallel=sp, init_std=cfg.init_method_std)
            self.q_norm = latent_norm(cfg.q_lora_rank, cfg, sp)
            self.q_up = ColumnParallelLinear(cfg.q_lora_rank, query_features, **column)
        else:
            self.q_proj = ColumnParallelLinear(h, query_features, **column)
        self.kv_down = ReplicatedLinear(h, cfg.kv_lora_rank + self.dr, sequence_parallel=sp,
                                        init_std=cfg.init_method_std)
        self.kv_norm = latent_norm(cfg.kv_lora_rank, cfg, sp)
        self.kv_up = ColumnParallelLinear(cfg.kv_lora_rank, n * (self.dq + self.dv), **column)
        self.proj = RowParallelLinear(n * self.dv, h, tp_group=ctx.group, bias=False, sequence_parallel=sp,
                                      init_std=scaled_init_std(cfg.init_method_std, cfg.num_layers))
        self.width = max(self.dq + self.dr, self.dv)  # what the core sees: q, k and v padded to one width
        # q x this = the softmax scale 1/sqrt(dq + dr) x YaRN's correction, under the core's 1/sqrt(width)
        self.query_scale = softmax_scale_correction(cfg) * (self.width / (self.dq + self.dr)) ** 0.5
        self.recompute_core = False  # selective recompute (``recompute.apply_recompute``): checkpoint the core
        self.logit_max: LogitMax | None = None  # --qk-clip-threshold: the core adds its per-head max logit here

    @property
    def core_eager(self) -> bool:
        """--compile: the core is a graph break (``compile.eager_sites`` sets it before the body is compiled)."""
        return self.__dict__.get("_core_eager", False)

    @core_eager.setter
    def core_eager(self, eager: bool) -> None:
        if eager and not _EAGER_ATTEND:  # torch.compiler.disable imports dynamo: only a compiled run pays it
            _EAGER_ATTEND["attend"] = torch.compiler.disable(MLA.attend, recursive=True)
        self.__dict__["_core_eager"] = eager

    def extra_repr(self) -> str:
        cfg = self.cfg
        shape = (f"heads={self.local_heads}, q_lora_rank={cfg.q_lora_rank}, kv_lora_rank={cfg.kv_lora_rank}, "
                 f"qk={self.dq}+{self.dr}, v={self.dv}")
        return ", ".join([shape] + [w for w, on in (("recompute=selective", self.recompute_core),
                                                     ("core eager", self.core_eager)) if on])

    def attend(self, q_bnsd: torch.Tensor, k_bnsd: torch.Tensor, v_bnsd: torch.Tensor,
               bounds: Bounds | None = None) -> torch.Tensor:
        """The core, checkpointed under selective recompute while grad is on."""
        if self.recompute_core and torch.is_grad_enabled():
            return checkpointed_core(self, self.core_attention, q_bnsd, k_bnsd, v_bnsd, bounds)
        return self.core_attention(q_bnsd, k_bnsd, v_bnsd, bounds)

    core_attention = core_attention  # ``sdpa.core_attention``: the one core, shared with Attention

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """``cache`` (decoding only): see ``decode``. ``documents`` (packed samples): positions that restart,
        attention kept in documents."""
        if cache is not None:
            return self.decode(x, cache)
        q_bnsd, k_bnsd, v_bnsd = self.heads(x, documents)
        bounds = None if documents is None else documents.bounds
        attend = _EAGER_ATTEND["attend"] if self.core_eager else MLA.attend
        out_bnsd = attend(self, q_bnsd, k_bnsd, v_bnsd, bounds)[..., :self.dv]
        return self.proj(rearrange(out_bnsd, "b n s d -> s b (n d)"))

    def decode(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The new tokens [s, b, h] after those in ``cache`` (a ``LatentKVCache``), with the up-projection
        absorbed: their [kv_norm(c_kv), RoPE(k_rope)] are cached; each query's no-position part is taken
        through kv_up's key rows into the latent (q_nope W_uk . c = q_nope . k_nope), attends over the
        cached latents and RoPE keys (one key "head" shared by all heads), and the attended latent goes
        through kv_up's value rows (p (c W_uv^T) = (p c) W_uv^T). Neither k_nope nor v is ever built."""
        if not isinstance(cache, LatentKVCache):
            raise TypeError("--multi-latent-attention decodes with a LatentKVCache (KVCache.for_model of an MLA "
                            f"config), not a {type(cache).__name__}")
        cfg, dq, dr, dv = self.cfg, self.dq, self.dr, self.dv
        q = self.q_up(self.q_norm(self.q_down(x))) if cfg.q_lora_rank is not None else self.q_proj(x)
        c_kv, k_rope = self.kv_down(x).split([cfg.kv_lora_rank, dr], dim=-1)
        cos, sin = rotary_cos_sin(cache.positions(x.shape[0], x.device), cfg, dr)
        k_rope_bsd = apply_rotary(rearrange(k_rope, "s b d -> b 1 s d"), cos, sin)[:, 0]
        new_bsc = torch.cat([rearrange(self.kv_norm(c_kv), "s b c -> b s c"), k_rope_bsd], dim=-1)
        cached_btc = cache.update_latent(self.layer_id, new_bsc).unsqueeze(1)  # [b, 1, t, rkv + dr]
        q_nope, q_rope = rearrange(q, "s b (n d) -> b n s d", d=dq + dr).split([dq, dr], dim=-1)
        w_uk, w_uv = rearrange(self.kv_up.weight, "(n d) c -> n d c", d=dq + dv).split([dq, dv], dim=1)
        query = torch.cat([torch.einsum("bnsd,ndc->bnsc", q_nope, w_uk), apply_rotary(q_rope, cos, sin)], dim=-1)
        scale = self.query_scale / self.width ** 0.5  # 1/sqrt(dq + dr) x YaRN's correction, as in training
        latent_bnsc = cached_attention(query, cached_btc, cached_btc[..., :cfg.kv_lora_rank], scale=scale)
        out_bnsd = torch.einsum("bnsc,ndc->bnsd", latent_bnsc, w_uv)
        return self.proj(rearrange(out_bnsd, "b n s d -> s b (n d)"))

    def heads(self, x: torch.Tensor,
              documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's queries, keys [b, n/tp, s, width] (q scaled) and values [b, n/tp, s, width or dv]."""
        cfg, dq, dr = self.cfg, self.dq, self.dr
        q = self.q_up(self.q_norm(self.q_down(x))) if cfg.q_lora_rank is not None else self.q_proj(x)
        c_kv, k_rope = self.kv_down(x).split([cfg.kv_lora_rank, dr], dim=-1)
        kv = self.kv_up(self.kv_norm(c_kv))  # [s, b, n/tp (dq + dv)]
        k_rope = shared_rope_key(k_rope, self.ctx.group, self.ctx.sequence_parallel)  # [s, b, dr]
        q_nope, q_rope = rearrange(q, "s b (n d) -> b n s d", d=dq + dr).split([dq, dr], dim=-1)
        k_nope, v = rearrange(kv, "s b (n d) -> b n s d", d=dq + self.dv).split([dq, self.dv], dim=-1)
        positions = self.ctx.positions(q.shape[0], x.device, documents)
        cos, sin = rotary_cos_sin(positions, cfg, dr)
        q_rope = apply_rotary(q_rope, cos, sin)
        k_rope = apply_rotary(rearrange(k_rope, "s b d -> b 1 s d"), cos, sin)
        query = torch.cat([q_nope, q_rope], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(-1, self.local_heads, -1, -1)], dim=-1)
        if self.query_scale != 1.0:
            query = query * self.query_scale
        pad_qk, pad_v = self.width - dq - dr, self.width - self.dv
        if pad_qk:
            query, key = F.pad(query, (0, pad_qk)), F.pad(key, (0, pad_qk))
        return query, key, F.pad(v, (0, pad_v)) if pad_v else v
