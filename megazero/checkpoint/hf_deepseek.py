"""DeepSeek-V3 hub-weight helpers: the RoPE row permutation and FP8 block dequantisation.

Building blocks for the DeepseekV3ForCausalLM conversion (issue 43); the key mapping itself is not wired into
``hf.py`` yet. The hub rotates the RoPE part of q/k in interleaved pairs ``(x0, x1), (x2, x3), ...`` (transformers'
``apply_rotary_pos_emb_interleave``); megazero's ``rope.apply_rotary`` rotates halves ``(x_i, x_{i+d/2})``.
Putting the even rows first and the odd rows after turns one layout into the other, and transformers' interleaved
rotation already returns its result in the halves layout, so attention scores agree exactly.
"""
from __future__ import annotations

import torch

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
