"""The key/value cache of autoregressive decoding (inference only; training never builds one).

Legend as in ``transformer.py``: b batch, g key/value heads, n query heads, s new tokens, t cached
plus new tokens, d head dim. Keys are cached after RoPE, so a decoding step rotates only its own
token. The cache is allocated once for the longest sequence it will hold, and one forward pass
writes every layer's keys and values at the same offset; ``advance`` then moves the offset.

With --multi-latent-attention the cache is a ``LatentKVCache``: per token and layer it holds MLA's
normalised latent (``kv_norm(c_kv)``, kv_lora_rank values) and the RoPE'd shared key (qk_pos_emb_head_dim
values), never the per-head keys and values, which ``mla.MLA`` never builds while decoding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig


class KVCache:
    """Keys and values of every layer, [b, g, capacity, d] each, filled up to ``length`` positions."""

    def __init__(self, num_layers: int, batch: int, groups: int, capacity: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (batch, groups, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity, self.length = capacity, 0

    @classmethod
    def for_model(cls, cfg: ModelConfig, batch: int, capacity: int, *, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> "KVCache":
        """An empty cache for a whole ``cfg`` model (tp 1) decoding ``batch`` sequences of up to ``capacity`` tokens:
        a ``LatentKVCache`` for an MLA model."""
        if cfg.multi_latent_attention:
            return LatentKVCache(cfg.num_layers, batch, capacity, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim,
                                 dtype=dtype, device=device)
        return cls(cfg.num_layers, batch, cfg.query_groups, capacity, cfg.head_dim, dtype=dtype, device=device)

    def positions(self, new_tokens: int, device: torch.device | str) -> torch.Tensor:
        """Positions [s] of the ``new_tokens`` tokens this forward pass adds."""
        if self.length + new_tokens > self.capacity:
            raise ValueError(f"the key/value cache holds {self.capacity} positions; {self.length} are used "
                             f"and {new_tokens} more were asked for")
        return torch.arange(self.length, self.length + new_tokens, device=device)

    def update(self, slot: int, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values of layer ``slot``; returns that layer's keys and values so far [b, g, t, d]."""
        end = self.length + k_bgsd.shape[2]
        self.keys[slot][:, :, self.length:end] = k_bgsd
        self.values[slot][:, :, self.length:end] = v_bgsd
        return self.keys[slot][:, :, :end], self.values[slot][:, :, :end]

    def advance(self, new_tokens: int) -> None:
        """Count the tokens every layer has now stored (called once per forward pass)."""
        self.length += new_tokens


class LatentKVCache(KVCache):
    """MLA's cache: per layer [b, capacity, kv_lora_rank + qk_pos_emb_head_dim], the normalised latent then the
    RoPE'd shared key of each token (``mla.MLA.decode``); no per-head keys or values (``keys``/``values`` empty)."""

    def __init__(self, num_layers: int, batch: int, capacity: int, latent_dim: int, rope_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(0, batch, 1, capacity, 1, dtype=dtype, device=device)
        self.latent_dim, self.rope_dim = latent_dim, rope_dim
        self.latents = [torch.zeros(batch, capacity, latent_dim + rope_dim, dtype=dtype, device=device)
                        for _ in range(num_layers)]

    @property
    def values_per_token(self) -> int:
        """Values one token keeps in one layer: kv_lora_rank + qk_pos_emb_head_dim."""
        return self.latents[0].shape[-1]

    def update(self, slot: int, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("an MLA (latent) cache holds no per-head keys and values; build the cache with "
                        "KVCache.for_model of the model's own config")

    def update_latent(self, slot: int, latent_bsc: torch.Tensor) -> torch.Tensor:
        """Store the new tokens' [latent, RoPE key] of layer ``slot``; returns that layer's so far [b, t, c]."""
        end = self.length + latent_bsc.shape[1]
        self.latents[slot][:, self.length:end] = latent_bsc
        return self.latents[slot][:, :end]


def cached_attention(q_bnsd: torch.Tensor, k_bgtd: torch.Tensor, v_bgtd: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention of s new queries over t = cached + s keys (``scale``: SDPA's, 1/sqrt(d) when None;
    v may be narrower or wider than q and k, as MLA's absorbed latent attention has it).

    The new queries sit at the last s of t positions, so query i sees keys up to t - s + i: SDPA's own
    ``is_causal`` aligns the mask top-left, which is right only when nothing is cached yet.
    """
    s, t = q_bnsd.shape[2], k_bgtd.shape[2]
    gqa = q_bnsd.shape[1] != k_bgtd.shape[1]
    if s == t:
        return F.scaled_dot_product_attention(q_bnsd, k_bgtd, v_bgtd, is_causal=True, enable_gqa=gqa, scale=scale)
    visible_st = torch.arange(t, device=q_bnsd.device) <= torch.arange(t - s, t, device=q_bnsd.device)[:, None]
    return F.scaled_dot_product_attention(q_bnsd, k_bgtd, v_bgtd, attn_mask=visible_st, enable_gqa=gqa, scale=scale)
