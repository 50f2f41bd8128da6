"""Rotary position embeddings: the frequencies (plain, Llama-3 or YaRN scaled), the cos/sin tables, the rotation.

Shared by the plain attention (``transformer.Attention``, which rotates whole heads of ``cfg.head_dim``) and
multi-head latent attention (``mla.MLA``, which rotates only the decoupled ``cfg.qk_pos_emb_head_dim`` part),
so it sits below both modules. The rotation is rotate-half (the layout HF Llama uses); DeepSeek's hub weights
are interleaved, which a conversion undoes by permuting the RoPE rows of the projections
(docs/architecture.md#mla-multi-head-latent-attention).
"""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig


def rotary_inv_freq(cfg: ModelConfig, device: torch.device | str, dim: int | None = None) -> torch.Tensor:
    """RoPE inverse frequencies [dim/2] (``dim``: the rotated width, ``cfg.head_dim`` by default), with Llama-3
    or YaRN scaling when ``cfg.rope_scaling_type`` says so.

    Llama-3 scaling stretches the context by keeping short wavelengths (they resolve nearby tokens),
    dividing long ones by ``factor`` (they are what stops generalising past the original length),
    and blending linearly, in 1/wavelength, between the two cut-offs.
    """
    dim = cfg.head_dim if dim is None else dim
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if cfg.rope_scaling_type is None:
        return inv_freq
    if cfg.rope_scaling_type == "yarn":
        return _yarn_inv_freq(cfg, dim, device)
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
    original = cfg.rope_scaling_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    blend = (original / wavelen - low) / (high - low)  # 0 at the long cut-off, 1 at the short one
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    long_scaled = torch.where(wavelen > original / low, inv_freq / factor, blended)
    return torch.where(wavelen < original / high, inv_freq, long_scaled)


def _yarn_inv_freq(cfg: ModelConfig, dim: int, device: torch.device | str) -> torch.Tensor:
    """YaRN (Peng et al. 2023, as DeepSeek-V3 and HF's rope_type 'yarn' compute it): a frequency pair that turns
    more than ``beta_fast`` times over the original context keeps its frequency (extrapolated), one that turns
    fewer than ``beta_slow`` times is divided by ``factor`` (interpolated), and the pairs between blend along a
    linear ramp over the pair index, whose ends are rounded outwards to whole pairs."""
    base, factor = cfg.rotary_base, cfg.rope_scaling_factor
    original = cfg.rope_scaling_original_max_position_embeddings

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns ``turns`` times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = float(max(math.floor(pair_turning(cfg.rope_scaling_beta_fast)), 0))
    high = float(min(math.ceil(pair_turning(cfg.rope_scaling_beta_slow)), dim - 1))
    if high == low:
        high += 0.001  # a ramp of one step, never a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    keep = 1 - ramp  # 1: extrapolated (the frequency kept), 0: interpolated (divided by the factor)
    wavelength_base = cfg.rotary_base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    return (1.0 / (factor * wavelength_base)) * (1 - keep) + (1.0 / wavelength_base) * keep


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 m ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_table_scale(cfg: ModelConfig) -> float:
    """What YaRN multiplies the cos/sin tables by: mscale(f, mscale) / mscale(f, mscale_all_dim) when the latter
    is set (DeepSeek-V3: both 1, so 1), else mscale(f, 1); 1 without YaRN."""
    if cfg.rope_scaling_type != "yarn":
        return 1.0
    factor = cfg.rope_scaling_factor
    if cfg.rope_scaling_mscale_all_dim:
        return yarn_mscale(factor, cfg.rope_scaling_mscale) / yarn_mscale(factor, cfg.rope_scaling_mscale_all_dim)
    return yarn_mscale(factor, 1.0)


def softmax_scale_correction(cfg: ModelConfig) -> float:
    """What MLA multiplies 1/sqrt(query/key width) by: mscale(f, mscale_all_dim)^2 under YaRN with
    mscale_all_dim set (DeepSeek-V3: 0.1 ln 40 + 1 squared, 1.874), else 1."""
    if cfg.rope_scaling_type != "yarn" or not cfg.rope_scaling_mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope_scaling_factor, cfg.rope_scaling_mscale_all_dim) ** 2


def rotary_cos_sin(positions: torch.Tensor, cfg: ModelConfig,
                   dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotate-half RoPE (the layout HF Llama uses) of ``dim`` features (``cfg.head_dim`` by
    default) at ``positions``: [s, dim] for global positions [s]; [b, 1, s, dim] (broadcast over heads) for
    per-sample positions [b, s]. YaRN scales both tables (``rotary_table_scale``)."""
    inv_freq = rotary_inv_freq(cfg, positions.device, dim)
    if positions.dim() == 2:
        angles = (positions.to(torch.float32).unsqueeze(-1) * inv_freq).unsqueeze(1)
    else:
        angles = torch.outer(positions.to(torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    scale = rotary_table_scale(cfg)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_rotary(x_bnsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_bnsd.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_bnsd.float() * cos + rotated.float() * sin).to(x_bnsd.dtype)
