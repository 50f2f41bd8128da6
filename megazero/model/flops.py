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

With --multi-latent-attention (``mla.py``: D = dq + dr the query/key head width, dv the value head width,
rq / rkv the latent widths) the attention rows are

    queries              2 * (h * rq + rq * n * D)   (no q LoRA: 2 * h * n * D)
    latent               2 * h * (rkv + dr)  +  2 * rkv * n * (dq + dv)   (down, then up to keys and values)
    scores  Q K^T        2 * s * n * D
    mix     P V          2 * s * n * dv     (the useful work: the core's zero-padded v columns are not counted)
    output projection    2 * n * dv * h

In an MoE layer (``cfg.is_moe_layer``) the MLP term counts the *active* parameters, what one token
runs through, never all E experts (F the routed expert width ``moe_ffn_size``, F_s the shared expert's,
m = 3 for llama's SwiGLU experts, 2 for gpt2's):

    router               2 * h * E
    routed experts       k * 2 * m * h * F
    shared expert        2 * m * h * F_s     (with --moe-shared-expert-intermediate-size)

so an MoE model costs what a dense one with f = k * F (+ F_s) costs, plus the router. A capacity run
counts the same k per token (what it computes usefully, as the head's unpadded vocabulary).

Under ``--reset-attention-mask`` scores and mix are multiplied by ``attended_share``,
the share of the causal pairs the document mask leaves: sum over documents of
L_d (L_d + 1) / 2 over S (S + 1) / 2 (``model.documents.attended_share``). A
causal kernel and the per-document kernels skip the same way, so the ratio is what
the mask saves; without the flag the formula above is used unchanged.

Multi-token prediction (``--mtp-num-layers D``, ``mtp.py``) adds per depth k, per token, in the forward: its block
(global layer ``num_layers + k - 1``: dense or MoE by ``is_moe_layer``, MLA or not, as a main layer), the
eh_proj 2 * 2h * h, and one more output head 2 * h * V. Recompute treats the MTP blocks as the chunk's last
blocks, as ``training/parallelize.py`` does (``apply_recompute(blocks_of(chunk))`` finds them after the main
layers): ``selective`` re-runs their attention cores too; ``full`` re-runs their block forwards when the first
N blocks reach them (N None: all of them, the main layers' and the D MTP blocks'; eh_proj and the head are
outside the checkpoint and never re-run). D = 0 leaves the figure bitwise as before.
"""
from __future__ import annotations

from ..config import ModelConfig


def mlp_forward_flops(cfg: ModelConfig, layer_id: int = 0) -> float:
    """Forward FLOPs per token of layer ``layer_id``'s MLP: the dense one, or an MoE layer's active part (router,
    k routed experts, the shared expert)."""
    h, mats = cfg.hidden_size, 3 if cfg.arch == "llama" else 2
    if not cfg.is_moe_layer(layer_id):
        return 2.0 * mats * h * cfg.ffn_size
    assert cfg.num_experts is not None
    active_width = cfg.moe_router_topk * cfg.moe_ffn_size + (cfg.moe_shared_expert_intermediate_size or 0)
    return 2.0 * h * cfg.num_experts + 2.0 * mats * h * active_width


def layer_forward_flops(cfg: ModelConfig, attended_share: float | None = None,
                        layer_id: int = 0) -> tuple[float, float]:
    """(whole layer, attention core only) forward FLOPs per token of transformer layer ``layer_id``;
    ``attended_share`` scales the core to the pairs a document mask leaves (None: full causal)."""
    h, n, g, d, s = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, cfg.seq_length
    projections, core = (mla_flops(cfg) if cfg.multi_latent_attention
                         else (2 * h * (n + 2 * g) * d + 2 * n * d * h, 2 * s * n * d * 2))
    if attended_share is not None:
        core *= attended_share
    total = projections + core + mlp_forward_flops(cfg, layer_id)
    return float(total), float(core)


def mla_flops(cfg: ModelConfig) -> tuple[float, float]:
    """(projections, core) forward FLOPs per token of one MLA layer (module docstring)."""
    h, n, s, dq, dr, dv = (cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length, cfg.qk_head_dim,
                           cfg.qk_pos_emb_head_dim, cfg.v_head_dim)
    rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    queries = h * n * (dq + dr) if rq is None else h * rq + rq * n * (dq + dr)
    latent = h * (rkv + dr) + rkv * n * (dq + dv)
    return 2.0 * (queries + latent + n * dv * h), 2.0 * s * n * (dq + dr + dv)


def flops_per_token(cfg: ModelConfig, recompute: str = "none", recompute_num_layers: int | None = None,
                    vocab_size: int | None = None, attended_share: float | None = None) -> float:
    """Training FLOPs (forward + backward + recomputation) per token.

    ``vocab_size`` is the head's width: the model's vocabulary by default (what the run computes
    usefully); the planner passes the padded one (what the GPU computes). ``attended_share``: the
    document mask's share of the causal pairs (``layer_forward_flops``).
    """
    vocab = cfg.vocab_size if vocab_size is None else vocab_size
    assert vocab is not None
    # the main layers, then the MTP blocks (the order recompute's "first N blocks" counts them in)
    layers = [layer_forward_flops(cfg, attended_share, layer_id)
              for layer_id in range(cfg.num_layers + cfg.mtp_depth)]
    head = 2.0 * cfg.hidden_size * vocab
    forward = sum(layer for layer, _ in layers[:cfg.num_layers]) + head
    if cfg.mtp_depth:  # per depth its block, the 2h -> h eh_proj and the shared head once more
        forward += sum(layer for layer, _ in layers[cfg.num_layers:]) + cfg.mtp_depth * (
            2.0 * 2 * cfg.hidden_size * cfg.hidden_size + head)
    extra = 0.0
    if recompute == "full":  # the first N blocks' forward again (their MLPs may differ: dense or MoE)
        extra = sum(layer for layer, _ in layers[:recompute_num_layers or len(layers)])
    elif recompute == "selective":
        extra = sum(core for _, core in layers)
    return 3.0 * forward + extra
