"""A multi-token prediction reference that slices where the model rolls and masks (``model/mtp.py``).

Depth k scores t_{i+k+1} from position i for the S - k positions that have one: the model's h^0 and each
module's own forward, run on those positions only (causal, so the later ones cannot reach them), then the
shared head and ``F.cross_entropy``. One document per sample (no packing).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def main_hidden_states(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """h^0 [s, b, h] of a whole serial ``GPTModel``: its last layer's output, before the final norm."""
    x = model.embedding(inputs)
    for layer in model.layers.values():
        x = layer(x)
    return x


def depth_token_losses(model: nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    """[b, S - k] token losses of each depth k = 1..D of ``tokens`` [b, S + 1]."""
    seq, vocab = tokens.shape[1] - 1, model.cfg.vocab_size
    h, out = main_hidden_states(model, tokens[:, :seq]), []
    for k, module in enumerate(model.mtp, start=1):
        kept = seq - k
        shifted = model.embedding.word(tokens[:, k:k + kept])  # [kept, b, h]: the embedding puts s first
        h = module(h[:kept], shifted, None)
        logits = F.linear(module.final_norm(h), model.output_weight)[..., :vocab]  # padded rows are no tokens
        targets = tokens[:, k + 1:k + 1 + kept].t()
        out.append(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
                   .view(kept, -1).t())
    return out


def lm_token_losses(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """[b, S] next-token losses of the main model."""
    logits = F.linear(model.final_norm(main_hidden_states(model, tokens[:, :-1])), model.output_weight)
    targets = tokens[:, 1:].t()
    return F.cross_entropy(logits[..., :model.cfg.vocab_size].flatten(0, 1).float(), targets.flatten(),
                           reduction="none").view(targets.shape).t()
