"""Parameter counts in closed form, and the model-state bytes they cost per rank.

Counts follow the modules in ``megazero.model`` exactly (so ``num_parameters``
equals ``count_parameters`` of the built model, vocabulary padding included):

    per block   norms       2 x (2h gpt2 LayerNorm | h llama RMSNorm)       replicated
                            (+ 2d q/k head norms with --qk-layernorm)       replicated
                qkv         (n + 2g) d h  (+ (n + 2g) d bias, gpt2)        split over TP
                proj        h n d                                          split
                            (+ h bias, gpt2)                               replicated
                mlp         gpt2: f h + f + h f (split), + h bias (replicated)
                            llama: 3 f h (gate, up, down; split)
    MLA         (--multi-latent-attention, in the qkv/proj/head-norm place; no biases; D = dq + dr, the
                query/key head width; rq / rkv the q / kv latent widths)
                q_down h rq + q_norm rq (replicated), q_up rq n D (split)      (no q LoRA: q_proj h n D, split)
                kv_down h (rkv + dr) + kv_norm rkv (replicated), kv_up rkv n (dq + dv) (split)
                proj n dv h (split)
    MoE layer   the router E h (replicated) and a shared expert (split) in the mlp's place;
                the routed experts are counted apart (``experts.py``: E / ep per rank, split over etp)
    embedding   V_pad h (split) + P h learned positions (gpt2, replicated); under pp > 1 the last stage
                holds a copy of the word embedding when it is tied or MTP embeds the shifted tokens
    head        final norm (replicated) + V_pad h output (split; only when untied)
    MTP         (--mtp-num-layers D, last stage, after the head) per depth enorm, hnorm h each, eh_proj
                2h h, one block (layer id num_layers + k: the last layer's kind), final norm h; replicated
                but for the block

Model-state bytes per parameter (mixed precision keeps an fp32 master copy
and two fp32 Adam moments, K = 12 in the ZeRO paper; fp32 training updates
the parameters in place, so K = 8):

    stage      params   grads        optimizer
    zero 0     w        g            K
    zero 1     w        g            K / dp
    zero 2     w        g / dp       K / dp
    zero 3     w / dp   g / dp       K / dp    (the paper's P_os+g+p)

with w = 2 (bf16/fp16) or 4 (fp32), g = 4 (fp32 main grads) or 2 (bf16).
This is the persistent state (the paper's arithmetic). During a step our ZeRO 2
also holds full-size bucket gradients (a full buffer while m > 1 micro-batches
accumulate); ``grads.py`` adds those, and the planner charges the peak. ZeRO 3
also holds the units gathered at its peak and its bucket gradients in flight
(``zero3.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..dtypes import DTYPES
from ..run_plan import ZeroStage
from .experts import expert_params, mlp_split_params, moe_mlp_params, moe_mlp_numels


@dataclass(frozen=True)
class ParamCount:
    """Parameters of one module group: ``split`` ones are divided over TP ranks."""

    split: int = 0
    replicated: int = 0

    def __add__(self, other: "ParamCount") -> "ParamCount":
        return ParamCount(self.split + other.split, self.replicated + other.replicated)

    def __mul__(self, k: int) -> "ParamCount":
        return ParamCount(self.split * k, self.replicated * k)

    @property
    def full(self) -> int:
        return self.split + self.replicated

    def per_rank(self, tp: int) -> int:
        assert self.split % tp == 0, (self, tp)
        return self.split // tp + self.replicated


def _norm(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden_size if cfg.arch == "gpt2" else cfg.hidden_size


def mla_param_numels(cfg: ModelConfig, tp: int) -> list[tuple[int, bool]]:
    """MLA's parameters on one TP rank in registration order, each (numel, replicated) (module docstring)."""
    h, n, dr, dv = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    d, rq, rkv = cfg.qk_head_dim + dr, cfg.q_lora_rank, cfg.kv_lora_rank
    query = [(h * rq, True), (rq, True), (rq * n * d // tp, False)] if rq is not None else [(h * n * d // tp, False)]
    return query + [(h * (rkv + dr), True), (rkv, True), (rkv * n * (cfg.qk_head_dim + dv) // tp, False),
                    (n * dv * h // tp, False)]


def attention_params(cfg: ModelConfig) -> ParamCount:
    """One block's attention (qkv, proj, head norms; or MLA's projections and latent norms)."""
    h, d = cfg.hidden_size, cfg.head_dim
    if cfg.multi_latent_attention:
        numels = mla_param_numels(cfg, 1)
        return ParamCount(sum(k for k, rep in numels if not rep), sum(k for k, rep in numels if rep))
    qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * d
    bias = cfg.arch == "gpt2"
    split = qkv * h + (qkv if bias else 0) + h * cfg.num_attention_heads * d
    replicated = (h if bias else 0) + (2 * d if cfg.qk_layernorm else 0)  # the proj bias, the q and k head norms
    return ParamCount(split, replicated)


def block_params(cfg: ModelConfig, layer_id: int = 0) -> ParamCount:
    """One block's parameters; an MoE layer's MLP slot holds the router and shared expert (the routed experts
    are counted apart, ``experts.py``)."""
    h, f = cfg.hidden_size, cfg.ffn_size
    bias = cfg.arch == "gpt2"
    attention = attention_params(cfg)
    split, replicated = attention.split, 2 * _norm(cfg) + attention.replicated  # + the two block norms
    if cfg.num_experts is not None and cfg.is_moe_layer(layer_id):  # a dense model never parses the pattern
        mlp_split, mlp_replicated = moe_mlp_params(cfg)
    else:
        mlp_split, mlp_replicated = mlp_split_params(cfg, f), (h if bias else 0)  # + the fc2 bias
    return ParamCount(split + mlp_split, replicated + mlp_replicated)


def embedding_params(cfg: ModelConfig, tp: int, with_positions: bool) -> ParamCount:
    positions = cfg.position_table_size * cfg.hidden_size if with_positions else 0
    return ParamCount(cfg.padded_vocab_size(tp) * cfg.hidden_size, positions)


def head_params(cfg: ModelConfig, tp: int) -> ParamCount:
    """Final norm plus, when untied, the output projection."""
    output = 0 if cfg.tied_embeddings else cfg.padded_vocab_size(tp) * cfg.hidden_size
    return ParamCount(output, _norm(cfg))


def mtp_params(cfg: ModelConfig) -> ParamCount:
    """The MTP modules' dense parameters (``model/mtp.py``): per depth enorm, hnorm, the 2h -> h eh_proj, one
    block (global layer id num_layers + k: the last layer's kind) and its final norm; embedding and head shared.
    Only the block splits over TP (the RMSNorms and eh_proj are replicated)."""
    h = cfg.hidden_size
    return sum((block_params(cfg, cfg.num_layers + k) + ParamCount(0, 2 * h * h + 3 * h)
                for k in range(cfg.mtp_depth)), ParamCount())


def mtp_param_numels(cfg: ModelConfig, tp: int) -> list[int]:
    """The MTP modules' dense parameters on one TP rank, in registration order (per depth: enorm, hnorm,
    eh_proj, the block's, final_norm): the post-process chunk registers them after its head."""
    h = cfg.hidden_size
    return [n for k in range(cfg.mtp_depth)
            for n in [h, h, 2 * h * h, *block_param_numels(cfg, tp, cfg.num_layers + k), h]]


def holds_word_embedding(cfg: ModelConfig, pre_process: bool, post_process: bool) -> bool:
    """Whether a chunk builds a word embedding (``GPTModel``): the first stage, and the last one when the
    embedding is tied to the head or the MTP depths embed the shifted tokens (a copy under pp > 1)."""
    return pre_process or (post_process and (cfg.tied_embeddings or cfg.mtp_depth > 0))


def embedding_shared_across_stages(cfg: ModelConfig, pp: int) -> bool:
    """The first and last stages each hold the word embedding (its buckets sit alone, summed over the
    embedding group: ``data_parallel/bucketing.py``)."""
    return pp > 1 and (cfg.tied_embeddings or cfg.mtp_depth > 0)


def num_parameters(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of the full model, as ``megazero.model.gpt.count_parameters`` counts them (MTP included)."""
    total = sum((block_params(cfg, i) for i in range(cfg.num_layers)), ParamCount())
    total = total + embedding_params(cfg, tp, cfg.arch == "gpt2") + head_params(cfg, tp)
    return (total + mtp_params(cfg)).full + expert_params(cfg)


def block_param_numels(cfg: ModelConfig, tp: int, layer_id: int = 0) -> list[int]:
    """One block's dense parameters on one TP rank, in registration order (norm1, qkv, proj, norm2, mlp; an MoE
    layer's router and shared expert in the mlp's place)."""
    h, f, gpt2 = cfg.hidden_size, cfg.ffn_size, cfg.arch == "gpt2"
    qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim // tp
    norm = [h, h] if gpt2 else [h]
    attn = [qkv * h, qkv, h * cfg.num_attention_heads * cfg.head_dim // tp, h] if gpt2 else \
        [qkv * h, h * cfg.num_attention_heads * cfg.head_dim // tp]
    attn += [cfg.head_dim, cfg.head_dim] if cfg.qk_layernorm else []  # q_norm, k_norm (after proj)
    if cfg.multi_latent_attention:
        attn = [numel for numel, _ in mla_param_numels(cfg, tp)]
    mlp = [f // tp * h, f // tp, h * f // tp, h] if gpt2 else [f // tp * h, f // tp * h, h * f // tp]
    return norm + attn + norm + (moe_mlp_numels(cfg, tp) if cfg.num_experts and cfg.is_moe_layer(layer_id) else mlp)


def chunk_param_numels(cfg: ModelConfig, tp: int, num_blocks: int, pre_process: bool,
                       post_process: bool, first_layer: int = 0) -> list[int]:
    """Element counts of one chunk's dense parameters on one TP rank, in ``GPTModel`` registration order
    (the word embedding first when the chunk has one; blocks from global layer ``first_layer``): what the
    optimizer's dense buckets are cut from."""
    numels: list[int] = []
    if holds_word_embedding(cfg, pre_process, post_process):
        numels.append(cfg.padded_vocab_size(tp) // tp * cfg.hidden_size)
        if pre_process and cfg.arch == "gpt2":
            numels.append(cfg.position_table_size * cfg.hidden_size)
    numels += [n for i in range(first_layer, first_layer + num_blocks) for n in block_param_numels(cfg, tp, i)]
    if post_process:
        numels += [cfg.hidden_size] * (2 if cfg.arch == "gpt2" else 1)  # final norm weight (, bias)
        if not cfg.tied_embeddings:
            numels.append(cfg.padded_vocab_size(tp) // tp * cfg.hidden_size)
        numels += mtp_param_numels(cfg, tp)
    return numels


def chunk_param_units(cfg: ModelConfig, num_blocks: int, pre_process: bool, post_process: bool,
                      layers_per_unit: int, first_layer: int = 0) -> list[int]:
    """The ZeRO-3 unit of each parameter of ``chunk_param_numels``, as ``data_parallel.zero3.plan_units``
    groups them: 0 is the chunk's root unit (embeddings, final norm, head, the MTP norms and eh_proj), block i
    is in unit 1 + i // layers_per_unit (the MTP blocks follow the chunk's blocks, as ``blocks_of`` finds them)."""
    embedding = 1 if holds_word_embedding(cfg, pre_process, post_process) else 0
    embedding += 1 if embedding and pre_process and cfg.arch == "gpt2" else 0
    tail = (2 if cfg.arch == "gpt2" else 1) + (0 if cfg.tied_embeddings else 1) if post_process else 0
    blocks = [1 + i // layers_per_unit for i in range(num_blocks)
              for _ in block_param_numels(cfg, 1, first_layer + i)]
    mtp = [u for k in range(cfg.mtp_depth if post_process else 0)
           for u in [0, 0, 0, *[1 + (num_blocks + k) // layers_per_unit]
                     * len(block_param_numels(cfg, 1, cfg.num_layers + k)), 0]]
    return [0] * embedding + blocks + [0] * tail + mtp


def chunk_params(cfg: ModelConfig, tp: int, num_blocks: int, pre_process: bool, post_process: bool,
                 first_layer: int = 0) -> int:
    """Dense parameters one rank holds for one model chunk (TP shard; the last stage's embedding copy and MTP
    modules included; blocks from global layer ``first_layer``; the routed experts apart, ``moe_plan.py``)."""
    total = sum((block_params(cfg, i) for i in range(first_layer, first_layer + num_blocks)), ParamCount())
    if holds_word_embedding(cfg, pre_process, post_process):
        total = total + embedding_params(cfg, tp, pre_process and cfg.arch == "gpt2")
    if post_process:
        total = total + head_params(cfg, tp) + mtp_params(cfg)
    return total.per_rank(tp)


@dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_param(precision: str, main_grads_dtype: str = "fp32") -> tuple[int, int, int]:
    """(w, g, K): compute weights, main grads, optimizer state (master + moments) bytes per parameter."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}.")
    if precision == "fp32":
        return 4, 4, 8
    return 2, (2 if main_grads_dtype == "bf16" else 4), 12


def model_state_bytes(num_params: float, dp: int, zero: int | ZeroStage, precision: str = "bf16",
                      main_grads_dtype: str = "fp32") -> StateBytes:
    """Bytes of params, grads and optimizer state for ``num_params`` parameters on one rank."""
    z = ZeroStage(zero)
    w, g, k = bytes_per_param(precision, main_grads_dtype)
    return StateBytes(params=num_params * w / (dp if z.shards_parameters else 1),
                      grads=num_params * g / (dp if z.shards_gradients else 1),
                      optimizer=num_params * k / (dp if z.shards_optimizer_state else 1))
