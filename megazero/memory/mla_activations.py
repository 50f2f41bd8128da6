"""What an MLA block's attention keeps for backward (``--multi-latent-attention``, ``model/mla.py``), term by term.

Measured with saved-tensor hooks as ``activations.py``'s terms are (``tests/memory/test_mla_activations.py``, to
the byte). Legend as there, plus rq = --q-lora-rank, rkv = --kv-lora-rank, dq / dr / dv the no-position, RoPE and
value head widths, W = max(dq + dr, dv) the width the core sees (q, k, v zero-padded to one width). The latent
side (down-projections, latent norms, up-projection inputs) is replicated over TP, so it is split only by SP's
sequence shard (r); the heads split over t. These replace the plain block's qkv / RoPE / core terms; the block's
norms, its two linear inputs (the normed x that q_down / q_proj and kv_down share, the MLP's) and the MLP stay:

    q latent norm       s b (2 rq + 1) 4 / r     (RMSNorm, in fp32 as the block's norms; with --q-lora-rank)
    q_up input          s b rq e / r             (the normed query latent; with --q-lora-rank)
    kv latent norm      s b (2 rkv + 1) 4 / r    (in fp32 the norm's input is a view of kv_down's output,
                                                  which then stays whole: s b (2 rkv + dr + 1) 4 / r)
    kv_up input         s b rkv e / r
    RoPE tables         2 s dr 4                 (fp32 cos/sin at dr; the rotated parts are concatenated
                                                  into q and k, whose copies the core keeps)
    core q, k, v        3 b n s W e / t          (SDPA's flash kernel keeps its inputs: q scaled, k with the
                                                  shared RoPE key expanded, v padded; an unpadded v, dv = W,
                                                  is a view of kv_up's output: s b n (dq + dv) e / t instead)
    log-sum-exp         b n s 4 / t
    core output         b n s W e / t
    proj input          s b n dv e / t           (the output cut to dv, a copy)

Selective recompute keeps the checkpointed core's inputs (q, k, v) but not its lse or output. CPU's math kernel
(attention dropout) keeps instead fp32 q (scaled), k and v, 3 b n s W 4 / t, and three fp32 s x s matrices
(3 b n s^2 4 / t; per document with --reset-attention-mask), and no output. Under context parallelism the
core is ``cp_attention`` on n heads of width W: the plain block's CP terms (``activations.cp_core_bytes``) with
g = n and d = W, the RoPE tables and the proj input as above.
"""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from .documents import square_sum

# ``a`` below: an ``activations.ActivationSpec`` (not imported: activations.py imports this module)


def core_width(cfg: ModelConfig) -> int:
    """W: the one width of the core's q, k and v (``MLA.width``)."""
    return max(cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim)


def _latent_terms(cfg: ModelConfig, a: Any) -> dict[str, int]:
    """The replicated side: latent norms and the up-projections' inputs, per SP shard."""
    sb, r, e = a.tokens * a.micro_batch_size, a.shard, a.dtype_bytes
    rkv, dr = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
    kv_norm_input = rkv + dr if e == 4 else rkv  # fp32: a view of kv_down's output; else its fp32 copy
    terms = {"kv_norm": sb * (rkv + kv_norm_input + 1) * 4 // r, "kv_up_input": sb * rkv * e // r}
    if cfg.q_lora_rank is not None:
        rq = cfg.q_lora_rank
        terms.update(q_norm=sb * (2 * rq + 1) * 4 // r, q_up_input=sb * rq * e // r)
    return terms


def mla_layer_terms(cfg: ModelConfig, a: Any, cp_core: dict[str, int] | None = None) -> dict[str, int]:
    """The attention terms of one MLA block for one micro-batch (module docstring), beyond norms, linear inputs
    and MLP; ``a.recompute`` none or selective (full recompute keeps the block's input only). ``cp_core``: under
    cp > 1, ``activations.cp_core_bytes`` at width W (the caller's, which imports this module)."""
    s, b, t, e = a.tokens, a.micro_batch_size, a.tp, a.dtype_bytes
    n, w, dr, dv = cfg.num_attention_heads, core_width(cfg), cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    heads = b * n * s * w * e // t
    # v unpadded (dv = W) is a view of kv_up's output [s, b, n (dq + dv)], which it keeps whole
    v_kept = s * b * n * (cfg.qk_head_dim + dv) * e // t if dv == w else heads
    terms = {**_latent_terms(cfg, a), "rope_tables": 2 * s * dr * 4, "proj_input": s * b * n * dv * e // t}
    if a.recompute == "selective":
        return {**terms, "core_qk": 2 * heads, "core_v": v_kept}
    if a.cp > 1:
        assert cp_core is not None, "under context parallelism the caller passes the CP core's terms"
        core = dict(cp_core)
        del core["rope"], core["attn_out"]  # RoPE ran before the core (tables above); one W-wide output
        return {**terms, **core, "core_out": heads}
    if a.attention_kernel(cfg) == "math":  # fp32 q (scaled), k, v of width W, whatever e; the s x s matrices
        fp32 = b * n * s * w * 4 // t
        return {**terms, "core_qk_fp32": 2 * fp32, "core_v_fp32": v_kept if e == 4 else fp32,
                "scores": 3 * b * n * square_sum(s, a.document_length) * 4 // t}
    return {**terms, "core_qk": 2 * heads, "core_v": v_kept, "lse": b * n * s * 4 // t, "core_out": heads}
