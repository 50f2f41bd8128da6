"""Autoregressive decoding with a key/value cache: greedy, or sampled with temperature, top-k and top-p.

The prompt is run once (prefill), filling the cache; each later step runs only the newest token,
which attends to the cached keys and values. Decoding stops at the end-of-document token (what the
model learnt ends a document) or after the requested number of new tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .gpt import GPTModel
from .kv_cache import KVCache


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen from the logits."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 divides the logits before sampling
    top_k: int = 0  # sample among the k most likely tokens; 0 = all of them
    top_p: float = 1.0  # sample among the fewest tokens whose probabilities reach p (nucleus); 1 = all

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1 = no limit), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def next_token(logits_bv: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token id [b] of each row of ``logits_bv`` [b, vocab]."""
    if sampling.greedy:
        return logits_bv.argmax(dim=-1)
    logits_bv = logits_bv.float() / sampling.temperature
    if 0 < sampling.top_k < logits_bv.shape[-1]:
        kth_best = logits_bv.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits_bv = logits_bv.masked_fill(logits_bv < kth_best, float("-inf"))
    if sampling.top_p < 1:
        sorted_bv, order_bv = logits_bv.sort(dim=-1, descending=True)
        probs_bv = sorted_bv.softmax(dim=-1)
        before_bv = probs_bv.cumsum(dim=-1) - probs_bv  # mass of the more likely tokens; the first is always kept
        drop_sorted_bv = before_bv >= sampling.top_p
        drop_bv = torch.empty_like(drop_sorted_bv).scatter(-1, order_bv, drop_sorted_bv)  # back to vocabulary order
        logits_bv = logits_bv.masked_fill(drop_bv, float("-inf"))
    return torch.multinomial(logits_bv.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def generate(model: GPTModel, prompt_ids: list[int], max_new_tokens: int, *, eos_id: int, sampling: Sampling,
             generator: torch.Generator | None = None) -> list[int]:
    """The new token ids that follow ``prompt_ids`` (an end-of-document token included, as the last one).

    ``model`` is a whole model in eval mode (see ``GPTModel.decode``).
    """
    assert prompt_ids and max_new_tokens >= 1
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    cache = KVCache.for_model(model.cfg, 1, len(prompt_ids) + max_new_tokens, dtype=dtype, device=device)
    logits_bv = model.decode(torch.tensor([prompt_ids], device=device), cache)[:, -1]
    new_ids: list[int] = []
    while True:
        token_b = next_token(logits_bv, sampling, generator)
        new_ids.append(int(token_b[0]))
        if new_ids[-1] == eos_id or len(new_ids) == max_new_tokens:
            return new_ids
        logits_bv = model.decode(token_b.view(1, 1), cache)[:, -1]
