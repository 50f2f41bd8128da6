"""The model's shape and family (``--arch``, sizes, positions, dropout, RoPE scaling): one config section.

Kept apart from ``config.py`` (which re-exports it) because the model, the planner and the
checkpoint converters read it without the rest of a run's configuration.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .config_fields import Needs, check_fields, opt, require, when
from .moe_config import MoEFields


@dataclass(frozen=True, kw_only=True)
class ModelConfig(MoEFields):
    arch: str = opt("gpt2", "Model family: gpt2 (learned positions, LayerNorm, GELU, tied embeddings, biases) "
                    "or llama (RoPE, RMSNorm, SwiGLU, no biases, GQA).", choices=("gpt2", "llama"))
    num_layers: int = opt(4, "Number of transformer blocks.", at_least=1)
    hidden_size: int = opt(256, "Model width.", at_least=1)
    num_attention_heads: int = opt(4, "Attention heads.", at_least=1)
    num_query_groups: int | None = opt(None, "Key/value heads for grouped-query attention; None = one per head.",
                                       at_least=1)
    kv_channels: int | None = opt(None, "Attention head dimension; None = --hidden-size / --num-attention-heads "
                                  "(Qwen3 models set it apart from that ratio).", at_least=1)
    ffn_hidden_size: int | None = opt(None, "MLP width; None = 4*hidden (gpt2) or 8/3*hidden rounded to 64 (llama).",
                                      at_least=1)
    seq_length: int = opt(128, "Tokens per training sample.", at_least=1)
    max_position_embeddings: int | None = opt(None, "Learned position table size (gpt2); None = --seq-length.",
                                              at_least=1)
    vocab_size: int | None = opt(None, "Tokenizer vocabulary; None = taken from the tokenizer.", at_least=1)
    make_vocab_size_divisible_by: int = opt(128, "Pad the vocabulary to a multiple of this times --tp.", at_least=1)
    hidden_dropout: float = opt(0.0, "Dropout after attention and MLP outputs and on embeddings.", at_least=0, below=1)
    attention_dropout: float = opt(0.0, "Dropout on attention probabilities.", at_least=0, below=1)
    norm_epsilon: float = opt(1e-5, "LayerNorm/RMSNorm epsilon.", above=0)
    rotary_base: float = opt(10000.0, "RoPE base frequency (llama).", above=0)
    rope_scaling_type: str | None = opt(None, "RoPE frequency scaling (llama): None = plain RoPE; llama3 = "
                                        "Llama-3.1 scaling (HF rope_type 'llama3') set by the four flags below; "
                                        "yarn = YaRN as DeepSeek-V3 states it (HF rope_type 'yarn'; with "
                                        "--multi-latent-attention), set by the factor, original length, beta and "
                                        "mscale flags.", choices=("llama3", "yarn"))
    rope_scaling_factor: float = opt(8.0, "llama3/yarn RoPE scaling: low frequencies are divided by this (HF "
                                     "factor).")
    rope_scaling_low_freq_factor: float = opt(1.0, "llama3 RoPE scaling: wavelengths above original length / this "
                                              "are divided by the factor (HF low_freq_factor).")
    rope_scaling_high_freq_factor: float = opt(4.0, "llama3 RoPE scaling: wavelengths below original length / this "
                                               "are kept; between the two they are blended (HF high_freq_factor).")
    rope_scaling_original_max_position_embeddings: int = opt(
        8192, "llama3/yarn RoPE scaling: context length the model was first trained at (HF "
        "original_max_position_embeddings).")
    rope_scaling_beta_fast: float = opt(32.0, "yarn RoPE scaling: dimensions turning more than this many times over "
                                        "the original length keep their frequency (HF beta_fast).", above=0,
                                        applies=when("rope_scaling_type", "yarn"))
    rope_scaling_beta_slow: float = opt(1.0, "yarn RoPE scaling: dimensions turning fewer times than this are "
                                        "divided by the factor; between the two they are blended (HF beta_slow).",
                                        above=0, applies=when("rope_scaling_type", "yarn"))
    rope_scaling_mscale: float = opt(1.0, "yarn RoPE scaling: cos/sin are multiplied by mscale(factor, this) / "
                                     "mscale(factor, --rope-scaling-mscale-all-dim), mscale(f, m) = 0.1 m ln f + 1 "
                                     "(HF mscale).", above=0, applies=when("rope_scaling_type", "yarn"))
    rope_scaling_mscale_all_dim: float = opt(0.0, "yarn RoPE scaling: the softmax scale is multiplied by mscale("
                                             "factor, this)^2; 0 = cos/sin scaled by mscale(factor, 1) instead (HF "
                                             "mscale_all_dim).", at_least=0, applies=when("rope_scaling_type", "yarn"))
    multi_latent_attention: bool = opt(False, "Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries through "
                                       "a low-rank latent (or one projection), keys and values from a shared "
                                       "compressed latent plus one decoupled RoPE key "
                                       "(docs/architecture.md#mla-multi-head-latent-attention).")
    q_lora_rank: int | None = opt(None, "MLA: the query latent's width; None = one query projection (as "
                                  "DeepSeek-V2-Lite).", at_least=1, applies=when("multi_latent_attention", True))
    kv_lora_rank: int = opt(32, "MLA: the key/value latent's width (what a cache would hold per token, with the "
                            "RoPE key).", at_least=1, applies=when("multi_latent_attention", True))
    qk_head_dim: int = opt(128, "MLA: the query/key head width without positions (HF qk_nope_head_dim).", at_least=1,
                           applies=when("multi_latent_attention", True))
    qk_pos_emb_head_dim: int = opt(64, "MLA: the decoupled RoPE part of each query/key head, the key's shared by "
                                   "all heads (HF qk_rope_head_dim).", at_least=2,
                                   applies=when("multi_latent_attention", True))
    v_head_dim: int = opt(128, "MLA: the value head width.", at_least=1, applies=when("multi_latent_attention", True))
    mla_latent_norm_epsilon: float | None = opt(None, "MLA: epsilon of the q and kv latents' RMSNorms; None = "
                                                "--norm-epsilon (transformers' DeepseekV3 uses 1e-6 whatever "
                                                "rms_norm_eps says).", above=0,
                                                applies=when("multi_latent_attention", True))
    qk_layernorm: bool = opt(False, "Per-head RMSNorm of queries and keys after the QKV projection, before RoPE "
                             "(llama family; Qwen3's q_norm/k_norm).")
    untie_embeddings_and_output_weights: bool | None = opt(
        None, "Separate output head; None = tied for gpt2, untied for llama.")
    init_method_std: float = opt(0.02, "Std of the normal initialiser; output projections use std/sqrt(2*layers).",
                                 above=0)
    mtp_num_layers: int | None = opt(None, "Multi-token prediction depth D (DeepSeek-V3): D extra modules after the "
                                     "last layer, module k predicting token t+1+k from the previous hidden state and "
                                     "the embedding of token t+k; None or 0 = off (docs/models.md#multi-token-"
                                     "prediction).", at_least=0)
    mtp_loss_scaling_factor: float = opt(0.1, "Weight of the MTP loss: the mean over the D depths of each depth's "
                                         "token-mean loss, times this, is added to the LM loss.", at_least=0,
                                         applies=Needs("--mtp-num-layers D >= 1", ("mtp_num_layers",), bool))

    def __hash__(self) -> int:
        """The planner caches per model (meta-device blocks); --moe-layer-freq is a list (argparse's nargs), so it
        is hashed as a tuple, which the generated hash would refuse."""
        values = (getattr(self, f.name) for f in fields(self))
        return hash(tuple(tuple(v) if isinstance(v, list) else v for v in values))

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.kv_channels is not None or self.multi_latent_attention
                or self.hidden_size % self.num_attention_heads == 0,
                 f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                 f"({self.num_attention_heads}); pick sizes whose ratio is the head dimension, or set --kv-channels.")
        require(self.arch != "llama" or self.multi_latent_attention or self.head_dim % 2 == 0,
                 f"the head dimension ({self.head_dim}) must be even for RoPE (it rotates pairs); pick an even "
                 "--kv-channels or --hidden-size / --num-attention-heads.")
        groups = self.query_groups
        require(1 <= groups <= self.num_attention_heads and self.num_attention_heads % groups == 0,
                 f"--num-attention-heads ({self.num_attention_heads}) must be divisible by --num-query-groups "
                 f"({groups}); use a divisor of the head count.")
        require(self.position_table_size >= self.seq_length,
                 f"--max-position-embeddings ({self.max_position_embeddings}) must be >= --seq-length "
                 f"({self.seq_length}).")
        require(not self.qk_layernorm or self.arch == "llama",
                 "--qk-layernorm needs --arch llama (it normalises RoPE queries and keys); drop the flag.")
        self._check_rope_scaling()
        self._check_mla()
        self._check_moe(self.num_layers)
        self._check_mtp()

    def _check_mtp(self) -> None:
        """MTP modules are RMSNorm + RoPE blocks fed by the word embedding alone (each block of the last layer's kind,
        dense or MoE), and each depth shifts by one more token: the family and the sequence must allow that."""
        depth = self.mtp_depth
        if not depth:
            return
        require(self.arch == "llama", f"--mtp-num-layers {depth} needs --arch llama (its modules take no learned "
                                      f"positions and normalise with RMSNorm); pass --arch llama.")
        require(self.seq_length > depth, f"--mtp-num-layers {depth} shifts each sample by up to {depth} tokens, so "
                                         f"--seq-length ({self.seq_length}) leaves depth {depth} no target; pass a "
                                         f"--seq-length above {depth} or fewer --mtp-num-layers.")

    def _check_mla(self) -> None:
        """MLA replaces the head layout: the flags of the plain one cannot apply to it."""
        if not self.multi_latent_attention:
            return
        require(self.arch == "llama", "--multi-latent-attention needs --arch llama (its decoupled key is RoPE; gpt2 "
                                      "has learned positions); pass --arch llama.")
        for given, name in ((self.num_query_groups, "--num-query-groups"), (self.kv_channels, "--kv-channels")):
            require(given is None, f"{name} does not apply with --multi-latent-attention (every head has its own key "
                                   f"and value, of --qk-head-dim + --qk-pos-emb-head-dim and --v-head-dim); drop it.")
        require(not self.qk_layernorm, "--qk-layernorm does not apply with --multi-latent-attention (its latents are "
                                       "normalised instead); drop it.")
        require(self.qk_pos_emb_head_dim % 2 == 0,
                f"--qk-pos-emb-head-dim ({self.qk_pos_emb_head_dim}) must be even for RoPE (it rotates pairs); pick "
                f"an even width.")

    def _check_rope_scaling(self) -> None:
        """Scaling values must make sense, and never be given without a type that uses them."""
        kind = self.rope_scaling_type
        require(kind is None or self.arch == "llama",
                 f"--rope-scaling-type {kind} needs --arch llama (gpt2 has no RoPE); drop the flag.")
        require(kind != "yarn" or self.multi_latent_attention,
                "--rope-scaling-type yarn is built for --multi-latent-attention only (its softmax-scale correction "
                "lives there); add it, or use --rope-scaling-type llama3.")
        shared = (self.rope_scaling_factor, self.rope_scaling_original_max_position_embeddings)
        require(kind is not None or shared == (8.0, 8192),
                "--rope-scaling-factor/-original-max-position-embeddings only apply with --rope-scaling-type llama3 "
                "or yarn; add it or drop them.")
        llama3_only = (self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor)
        require(kind == "llama3" or llama3_only == (1.0, 4.0),
                "--rope-scaling-low-freq-factor/-high-freq-factor only apply with --rope-scaling-type llama3; add it "
                "or drop them.")
        require(kind != "yarn" or self.rope_scaling_mscale == 1.0 or self.rope_scaling_mscale_all_dim > 0,
                f"--rope-scaling-mscale {self.rope_scaling_mscale} needs a nonzero --rope-scaling-mscale-all-dim (with "
                f"0 the cos/sin scale is mscale(factor, 1), as transformers reads it); pass both or drop it.")
        require(self.rope_scaling_factor >= 1.0,
                 f"--rope-scaling-factor must be >= 1, got {self.rope_scaling_factor}.")
        require(0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor,
                 f"--rope-scaling-low-freq-factor ({self.rope_scaling_low_freq_factor}) must be > 0 and below "
                 f"--rope-scaling-high-freq-factor ({self.rope_scaling_high_freq_factor}).")
        require(self.rope_scaling_original_max_position_embeddings >= 1,
                 f"--rope-scaling-original-max-position-embeddings must be >= 1, got "
                 f"{self.rope_scaling_original_max_position_embeddings}.")

    @property
    def mtp_depth(self) -> int:
        """D, the multi-token prediction modules (0 = off)."""
        return self.mtp_num_layers or 0

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.arch == "gpt2":
            return 4 * self.hidden_size
        return 64 * -(-(8 * self.hidden_size // 3) // 64)

    @property
    def tied_embeddings(self) -> bool:
        untie = self.untie_embeddings_and_output_weights
        return (self.arch == "gpt2") if untie is None else not untie

    @property
    def position_table_size(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up so every TP rank holds an equal, aligned slice."""
        assert self.vocab_size is not None, "vocab_size is set from the tokenizer before the model is built"
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple
