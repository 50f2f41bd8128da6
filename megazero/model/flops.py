"""Model FLOPs per token: the one formula the trainer's MFU and the layout planner both use.

We count matrix-multiply FLOPs only (2 per multiply-add), as Megatron-LM and
the PaLM paper do; norms, softmax, biases and element-wise ops are noise at
scale. Per token and layer, in the forward pass (h hidden, n heads, g query
groups, d = h/n head dim, f MLP width, s sequence length, V vocabulary):

    QKV projection       2 * h * (n + 2g) * d
    scores  Q K^T        2 * s * n * d          (the full s x s square: the
    mix     P V          2 * s * n * d           convention Megatron uses too)
    output projection    2 * n * d * h
    MLP                  2 * 2 * h * f  (gpt2)  or  2 * 3 * h * f  (llama, SwiGLU)

plus the output head, 2 * h * V, once per token. Backward costs twice the
forward. Recomputation adds forward work again: ``full`` re-runs the whole
forward of the recomputed layers, ``selective`` only the attention core
(scores and mix).

Under ``--reset-attention-mask`` scores and mix are multiplied by ``attended_share``,
the share of the causal pairs the document mask leaves: sum over documents of
L_d (L_d + 1) / 2 over S (S + 1) / 2 (``model.documents.attended_share``). A
causal kernel and the per-document kernels skip the same way, so the ratio is what
the mask saves; without the flag the formula above is used unchanged.
"""
from __future__ import annotations

from ..config import ModelConfig


def layer_forward_flops(cfg: ModelConfig, attended_share: float | None = None) -> tuple[float, float]:
    """(whole layer, attention core only) forward FLOPs per token of one transformer layer; ``attended_share``
    scales the core to the pairs a document mask leaves (None: full causal)."""
    h, n, g, d, f, s = (cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim,
                        cfg.ffn_size, cfg.seq_length)
    core: float = 2 * s * n * d * 2
    if attended_share is not None:
        core *= attended_share
    mlp_mats = 3 if cfg.arch == "llama" else 2
    total = 2 * h * (n + 2 * g) * d + core + 2 * n * d * h + 2 * mlp_mats * h * f
    return float(total), float(core)


def flops_per_token(cfg: ModelConfig, recompute: str = "none", recompute_num_layers: int | None = None,
                    vocab_size: int | None = None, attended_share: float | None = None) -> float:
    """Training FLOPs (forward + backward + recomputation) per token.

    ``vocab_size`` is the head's width: the model's vocabulary by default (what the run computes
    usefully); the planner passes the padded one (what the GPU computes). ``attended_share``: the
    document mask's share of the causal pairs (``layer_forward_flops``).
    """
    vocab = cfg.vocab_size if vocab_size is None else vocab_size
    assert vocab is not None
    layer, core = layer_forward_flops(cfg, attended_share)
    head = 2.0 * cfg.hidden_size * vocab
    forward = cfg.num_layers * layer + head
    extra = 0.0
    if recompute == "full":
        extra = (recompute_num_layers or cfg.num_layers) * layer
    elif recompute == "selective":
        extra = cfg.num_layers * core
    return 3.0 * forward + extra
