"""DeepseekV3ForCausalLM weights <-> megazero tensors (MLA, MoE, MTP): the RoPE row order, FP8 dequantisation.

The hub rotates the RoPE part of q/k in interleaved pairs ``(x0, x1), (x2, x3), ...`` (transformers'
``apply_rotary_pos_emb_interleave``); megazero's ``rope.apply_rotary`` rotates halves ``(x_i, x_{i+d/2})``.
Putting the even rows first and the odd rows after turns one layout into the other, and transformers' interleaved
rotation already returns its result in the halves layout, so attention scores agree exactly. The rows permuted are
the RoPE rows of each query head (``q_b_proj`` / ``q_proj``) and of the shared RoPE key (``kv_a_proj_with_mqa``'s
last qk_rope_head_dim rows); an export writes the hub's interleaved layout (``rope_interleave`` true).

Per layer: ``self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj}``; a dense ``mlp.{gate,up,down}_proj``, or ``mlp.gate.weight`` (router), ``mlp.gate.e_score_correction_bias``
(megazero's ``expert_bias`` buffer), ``mlp.experts.{e}.{gate,up,down}_proj`` (or transformers 5's stacked
``experts.gate_up_proj`` / ``experts.down_proj``) and ``mlp.shared_experts.*``. MTP module k is hub layer
``num_hidden_layers + k``: ``enorm``, ``hnorm``, ``eh_proj``, a decoder layer, ``shared_head.norm`` and copies of
the embedding (``embed_tokens``) and the head (``shared_head.head``), which megazero shares: an import takes the
copies only when they equal the model's own, an export writes them.

FP8 hub weights: a ``W`` with a ``W_scale_inv`` companion is ``float(W) * scale_inv`` per 128 x 128 block.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig

FP8_BLOCK = 128  # the hub's weight_block_size: one float32 scale_inv per 128 x 128 block


def interleaved_to_halves(rope_dim: int) -> torch.Tensor:
    """Row order that turns interleaved RoPE rows into rotate-half rows: evens, then odds (import)."""
    if rope_dim % 2:
        raise ValueError(f"qk_rope_head_dim ({rope_dim}) must be even for RoPE; the HF config is not a valid DeepSeek")
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def halves_to_interleaved(rope_dim: int) -> torch.Tensor:
    """The inverse row order of ``interleaved_to_halves`` (export)."""
    return torch.argsort(interleaved_to_halves(rope_dim))


def permute_rope_rows(weight: torch.Tensor, head_dim: int, rope_offset: int, rope_dim: int,
                      order: torch.Tensor) -> torch.Tensor:
    """Reorder the rope rows [rope_offset, rope_offset + rope_dim) inside every ``head_dim``-row head of ``weight``.

    q_b_proj / q_proj: ``head_dim = qk_nope + qk_rope``, ``rope_offset = qk_nope`` (per head);
    kv_a_proj_with_mqa: ``head_dim`` = all its rows (one "head"), ``rope_offset = kv_lora_rank``.
    """
    if weight.shape[0] % head_dim:
        raise ValueError(f"{weight.shape[0]} rows are not a whole number of {head_dim}-row heads")
    heads = weight.reshape(weight.shape[0] // head_dim, head_dim, *weight.shape[1:]).clone()
    rope = heads[:, rope_offset:rope_offset + rope_dim]
    heads[:, rope_offset:rope_offset + rope_dim] = rope[:, order]
    return heads.reshape(weight.shape)


def dequantize_fp8_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """``w[i, j] = float(fp8[i, j]) * scale_inv[i // block, j // block]`` (scale_inv: [ceil(rows/block),
    ceil(cols/block)], float32); edge blocks are partial, so shapes need not divide by ``block``."""
    rows, cols = weight.shape
    want = (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)}"
                         f" in {block}x{block} blocks (expected {want})")
    scale = scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.float() * scale


State = dict[str, torch.Tensor]
# A read-tracking view of the HF state (hf._Reads): ``src[key]`` marks the key taken, a missing one raises.
Source = Any
# megazero (under ``attention.``) -> hub (under ``self_attn.``) names of the MLA weights
_MLA_Q_LORA = {"q_down.weight": "q_a_proj.weight", "q_norm.weight": "q_a_layernorm.weight",
               "q_up.weight": "q_b_proj.weight"}
_MLA_KV = {"kv_down.weight": "kv_a_proj_with_mqa.weight", "kv_norm.weight": "kv_a_layernorm.weight",
           "kv_up.weight": "kv_b_proj.weight", "proj.weight": "o_proj.weight"}
# megazero -> hub names of a SwiGLU MLP (fc1 is the up projection), dense or the shared expert
_MLP = {"gate.weight": "gate_proj.weight", "fc1.weight": "up_proj.weight", "fc2.weight": "down_proj.weight"}
_EXPERTS = (("gate_weight", "gate_proj"), ("fc1_weight", "up_proj"), ("fc2_weight", "down_proj"))
_BLOCK_NORMS = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight"}
# megazero (under ``mtp.{k}.``) -> hub (under ``model.layers.{num_hidden_layers + k}.``) names of an MTP module
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "final_norm.weight": "shared_head.norm.weight"}


def _mla_names(cfg: ModelConfig) -> dict[str, str]:
    return {**(_MLA_Q_LORA if cfg.q_lora_rank is not None else {"q_proj.weight": "q_proj.weight"}), **_MLA_KV}


def _rope_rows(name: str, weight: torch.Tensor, cfg: ModelConfig, order: torch.Tensor) -> torch.Tensor:
    """``weight`` (megazero name ``name``) with its RoPE rows in ``order``; other weights unchanged."""
    dq, dr, rkv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.kv_lora_rank
    if name in ("q_up.weight", "q_proj.weight"):
        return permute_rope_rows(weight, dq + dr, dq, dr, order)
    if name == "kv_down.weight":
        return permute_rope_rows(weight, rkv + dr, rkv, dr, order)
    return weight


def block_to_hf(src: State, ours: str, theirs: str, cfg: ModelConfig) -> State:
    """One decoder layer (megazero prefix ``ours``, e.g. ``layers.3.``) under the hub prefix ``theirs``."""
    order = halves_to_interleaved(cfg.qk_pos_emb_head_dim)
    out = {theirs + h: src[ours + m] for m, h in _BLOCK_NORMS.items()}
    out.update({f"{theirs}self_attn.{h}": _rope_rows(m, src[f"{ours}attention.{m}"], cfg, order)
                for m, h in _mla_names(cfg).items()})
    p, o = ours + "mlp.", theirs + "mlp."
    if p + "router.weight" not in src:
        return {**out, **{o + h: src[p + m] for m, h in _MLP.items()}}
    bias = src.get(p + "router.expert_bias")
    out[o + "gate.weight"] = src[p + "router.weight"]
    out[o + "gate.e_score_correction_bias"] = (bias if bias is not None else  # no bias: zeros, the same choice
                                               torch.zeros(cfg.num_experts or 0, dtype=torch.float32))
    for m, h in _EXPERTS:
        out.update({f"{o}experts.{e}.{h}.weight": w.t() for e, w in enumerate(src[f"{p}experts.{m}"])})
    return {**out, **{f"{o}shared_experts.{h}": src[f"{p}shared_expert.{m}"] for m, h in _MLP.items()}}


def block_from_hf(src: Source, ours: str, theirs: str, cfg: ModelConfig, moe: bool) -> State:
    """The inverse of ``block_to_hf``; ``moe``: whether megazero's block routes."""
    order = interleaved_to_halves(cfg.qk_pos_emb_head_dim)
    out = {ours + m: src[theirs + h] for m, h in _BLOCK_NORMS.items()}
    out.update({f"{ours}attention.{m}": _rope_rows(m, src[f"{theirs}self_attn.{h}"], cfg, order)
                for m, h in _mla_names(cfg).items()})
    p, o = ours + "mlp.", theirs + "mlp."
    if not moe:
        return {**out, **{p + m: src[o + h] for m, h in _MLP.items()}}
    out[p + "router.weight"] = src[o + "gate.weight"]
    bias = src[o + "gate.e_score_correction_bias"]
    if cfg.moe_router_enable_expert_bias:
        out[p + "router.expert_bias"] = bias.to(torch.float32)
    elif bias.any():
        raise ValueError(f"the HF weights' {o}gate.e_score_correction_bias is not zero and the model has no "
                         "--moe-router-enable-expert-bias (converting would drop it); convert with it.")
    if o + "experts.gate_up_proj" in src:  # transformers 5's in-memory layout: [E, 2F, H] (gate rows first), [E, H, F]
        gate, up = src[o + "experts.gate_up_proj"].transpose(1, 2).chunk(2, dim=2)
        out.update({p + "experts.gate_weight": gate, p + "experts.fc1_weight": up,
                    p + "experts.fc2_weight": src[o + "experts.down_proj"].transpose(1, 2)})
    else:
        out.update({f"{p}experts.{m}": torch.stack([src[f"{o}experts.{e}.{h}.weight"].t()
                                                     for e in range(cfg.num_experts or 0)]) for m, h in _EXPERTS})
    return {**out, **{f"{p}shared_expert.{m}": src[f"{o}shared_experts.{h}"] for m, h in _MLP.items()}}


def mtp_to_hf(src: State, cfg: ModelConfig, embedding: torch.Tensor, head: torch.Tensor) -> State:
    """Every MTP module as hub layer ``num_layers + k``, with its copies of the (vocabulary-trimmed) embedding and
    output head."""
    out: State = {}
    for k in range(getattr(cfg, "mtp_depth", 0)):
        ours, theirs = f"mtp.{k}.", f"model.layers.{cfg.num_layers + k}."
        out.update({theirs + h: src[ours + m] for m, h in _MTP.items()})
        out.update(block_to_hf(src, ours + "block.", theirs, cfg))
        out[theirs + "embed_tokens.weight"], out[theirs + "shared_head.head.weight"] = embedding, head
    return out


def mtp_from_hf(src: Source, cfg: ModelConfig, embedding: torch.Tensor, head: torch.Tensor) -> State:
    """Every MTP module from hub layer ``num_layers + k``; the layer's embedding and head copies, when present,
    must equal the model's (megazero shares them: a different copy would be dropped)."""
    out: State = {}
    for k in range(getattr(cfg, "mtp_depth", 0)):
        ours, theirs = f"mtp.{k}.", f"model.layers.{cfg.num_layers + k}."
        out.update({ours + m: src[theirs + h] for m, h in _MTP.items()})
        out.update(block_from_hf(src, ours + "block.", theirs, cfg, moe=theirs + "mlp.gate.weight" in src))
        for name, shared in (("embed_tokens.weight", embedding), ("shared_head.head.weight", head)):
            if theirs + name in src and not torch.equal(src[theirs + name], shared):
                raise ValueError(f"the HF weights' {theirs + name} differs from the model's own "
                                 f"{'embedding' if 'embed' in name else 'output head'}, which megazero's MTP shares "
                                 "(converting would drop it); convert a checkpoint whose MTP layer shares them.")
    return out


def dequantize_state(state: State) -> State:
    """``state`` with every FP8 ``W`` that has a ``W_scale_inv`` companion dequantised (float32) and the companion
    taken; an FP8 weight without one, or a companion whose weight is not FP8, is refused naming it. A companion
    without its weight stays, for the caller's unread-tensor check to name."""
    out: State = {}
    for name, t in state.items():
        scale = state.get(name + "_scale_inv")
        if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in state:
            continue
        if scale is not None:
            if t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"the HF weights' {name} has a weight_scale_inv but dtype {t.dtype}, not "
                                 "float8_e4m3fn; convert a folder whose quantised weights are FP8.")
            out[name] = dequantize_fp8_blockwise(t, scale)
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"the HF weights' {name} is {t.dtype} without its {name}_scale_inv; convert a folder "
                             "that holds every FP8 weight's block scales.")
        else:
            out[name] = t
    return out


def hub_rope_layout(config: dict[str, Any], state: State) -> State:
    """A checkpoint saved with ``rope_interleave`` false (RoPE rows already rotate-half) in the hub's interleaved
    layout, which ``block_from_hf`` reads: the rows of every q and RoPE-key projection reordered."""
    if config.get("rope_interleave", True):
        return state
    nope, rope, rkv = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["kv_lora_rank"]
    order, out = halves_to_interleaved(rope), dict(state)
    for name, t in state.items():
        if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            out[name] = permute_rope_rows(t, nope + rope, nope, rope, order)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            out[name] = permute_rope_rows(t, rkv + rope, rkv, rope, order)
    return out
