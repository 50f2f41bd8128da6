"""Bytes autograd keeps for backward, per micro-batch, term by term.

This is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", per layer ``s b h (34 + 5 a s / h)`` bytes in fp16)
recalibrated to what *our* blocks save, as measured with saved-tensor hooks
(``tests/helpers/saved_tensors.py``). Legend: s sequence, b micro-batch, h hidden,
f MLP width, n heads, g query groups, d head dim, t TP size, e bytes per
activation element (4 fp32, 2 bf16), r = t with sequence parallelism else 1
(replicated regions are sequence-sharded only with SP), V_pad padded vocab.
The figures are what CPU's kernels keep (measured to the byte, fp32 and bf16); where CUDA's
differ and are known they are kept apart (``device``): LayerNorm statistics, dropout masks, the
attention kernel. CUDA may run RMSNorm fused (input and rstd only): not measured, planned as CPU's.

Per block, no recompute, flash attention (SDPA's flash kernel: CUDA always,
CPU when attention dropout is 0; it keeps q, k, v, the output and a
log-sum-exp but no s x s matrix, so the paper's 5 a s / h term is gone):

    norm inputs           2 x s b h e / r       (+ stats 2 x 2 s b 4 / r, LayerNorm; e bytes on CPU)
    RMSNorm (llama)       2 x s b (2 h + 1) 4 / r  (unfused, in fp32 whatever e is: the fp32 input,
                          a copy below fp32; the fp32 normalised pre-weight value; rstd)
    linear inputs         2 x s b h e / r       (qkv and MLP-in inputs, llama's gate and up
                                                 sharing one; under SP the local shard, which
                                                 the column-parallel layer re-gathers in backward)
    qkv output            s b (n + 2g) d e / t  (held by the q/k/v views SDPA saves)
    RoPE (llama)          s b (n + g) d e / t + 2 s d 4   (rotated q, k; cos/sin tables)
    SDPA log-sum-exp      b n s 4 / t
    attention output      s b h e / t           (also the out-projection's input;
                                                 x 2 with GQA, where the projection copies it)
    MLP                   gpt2: 2 s b f e / t (GELU in/out); llama: 4 s b f e / t
                          (gate, silu(gate), up, product)
    hidden dropout        2 x s b h m / r       (m = mask bytes: 1 on CUDA, e on CPU)
    q/k head norms        s b (n + g) (2 d + 1) 4 / t   (--qk-layernorm: per head an fp32 copy of the
                          input, the fp32 normalised value, rstd; in fp32 the inputs are the qkv
                          output's views, so only GQA's rearranged q is a copy, and k's view keeps
                          the qkv output alive where no other term does; the normed q lays the flash
                          output out so the out-projection copies it, as with GQA)

The math kernel (CPU with attention dropout) computes in fp32: it drops the rotated q, k
and the lse (RoPE keeps its tables) and keeps fp32 q (scaled), k and v expanded to n
heads, s b n d 4 / t each (v is the qkv output's view only for fp32 MHA: then the qkv
output), the output (e), and three b n s^2 4 / t matrices (softmax, mask, dropped).
With ``--reset-attention-mask`` (``documents.py``: documents of a planned length L_d) the
kernels run once per document: the math kernel's matrices are b n sum_d L_d^2 4 / t each,
and the flash kernel's calls write into one attention output, kept once.
Selective recompute keeps only the core's inputs (qkv output, rotated q, k)
and its output. Full recompute keeps only ``s b h e / r`` per block.
With --multi-latent-attention the qkv, RoPE, core and head-norm terms are MLA's (``mla_activations.py``).

Per stage: the first adds token ids (s b 8; at tp = cp = 1 a view of the [b, s + 1]
micro-batch, b 8 more; + s b for the TP>1 mask) and an embedding-dropout mask; the last
adds the final norm, the head's input ``s b h e / r`` (SP: the local shard, as the linear
inputs) and the cross entropy's fp32 softmax ``s b V_pad / t x 4`` plus targets (s b 9); with
``--mtp-num-layers D`` also D MTP depths (``mtp_terms``: a block each, their inputs, D more heads).
With ``--cross-entropy-chunk-size c`` the fused head keeps instead the gradients it computed
in forward: dh ``s b h e / r`` and an fp32 dW ``V_pad / t x h x 4``; its logits are a
transient of c tokens (``head_working_bytes``), not of s b.

Context parallelism (cp > 1): every term above is per token, so s is the
rank's S/cp tokens (measured: ``tests/memory/test_cp_memory.py``). What the CP
attention core (``context_parallel/attention.py``) keeps instead of SDPA's:

    p2p (ring)   q, k, v as contiguous copies (llama: the rotated q, k and a copy
                 of v), the output (+ the out-projection's copy of it) and an fp32
                 log-sum-exp: the flash terms without the qkv output's storage
    a2a / hybrid q, k, v and the output gathered to n/U heads of U x s tokens (the
                 same bytes; GQA kv heads replicated to lcm(g/t, U) when U does not
                 divide them), the log-sum-exp, the output scattered back; RoPE
                 keeps only its cos/sin tables. Under document masks pure a2a keeps
                 this rank's q, k, v, output and lse, plus its heads' q, k, v, output
                 and lse of the tokens whose documents travel (``a2a_shared_tokens``)
    dropout      the hidden-dropout mask is a float tensor (e bytes, also on CUDA):
                 drawn for the whole sequence, this rank's rows kept
    gpt2         the learned-position lookup keeps its s x 8 index

Besides what it keeps, the ring holds a working set while a layer's attention
runs (``cp_working_bytes``, charged as a transient): in the backward the K/V in
hand and the one arriving (2 x 2 s b g d e / t), three fp32 dK/dV accumulators
(the one filling, the one being sent, the one arriving: 3 x 2 s b g d 4 / t) and
the fp32 dQ (s b n d 4 / t); the all-to-alls hold, in the backward, the gradients
of the gathered q, k, v (the bytes of the ``qkv`` term) and one all-to-all's send and
receive buffers (2 x s b n d e / t). These are estimates of what one layer's CP core
adds at its peak, not a replay: the measured forward + backward peak is within
-11% .. +9% of activations + transient at cp 2 and 4 (``tests/memory/test_cp_memory.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from .documents import a2a_shared_tokens, square_sum
from .mla_activations import core_width, mla_layer_terms


@dataclass(frozen=True)
class ActivationSpec:
    """What decides the saved bytes of one micro-batch on one rank."""

    seq_length: int
    micro_batch_size: int
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    dtype_bytes: int = 2
    device: str = "cuda"  # kernel facts: dropout mask bytes, attention kernel with dropout
    training: bool = True
    cp: int = 1  # context-parallel size: each rank keeps seq_length / cp tokens of a sample
    cp_comm_type: str = "p2p"  # "p2p" (ring), "a2a" (Ulysses) or "a2a+p2p"
    cp_a2a: int = 1  # U: ranks per all-to-all group (1 ring only, cp all-to-all only)
    ce_chunk_size: int = 0  # --cross-entropy-chunk-size: > 0, the fused head + loss, this many tokens at a time
    document_length: int | None = None  # --reset-attention-mask: the planned document length (``documents.py``)

    @property
    def shard(self) -> int:
        return self.tp if self.sequence_parallel else 1

    @property
    def ring(self) -> int:
        """Ring positions of the CP group (cp / U; 1 for all-to-all alone or no CP)."""
        return self.cp // self.cp_a2a

    @property
    def tokens(self) -> int:
        """Tokens of one sample on this rank: the whole sequence, or its 1/cp under context parallelism."""
        return self.seq_length // self.cp

    def attention_kernel(self, cfg: ModelConfig) -> str:
        dropout = self.training and cfg.attention_dropout > 0
        return "math" if (self.device == "cpu" and dropout) else "flash"

    def mask_bytes(self) -> int:
        """Hidden-dropout mask bytes per element: bool on CUDA; a float mask on CPU or under CP."""
        return 1 if self.device == "cuda" and self.cp == 1 else self.dtype_bytes


def _norm_bytes(cfg: ModelConfig, a: ActivationSpec) -> int:
    """One norm's saved bytes (input, stats, and for RMSNorm the pre-weight value; module docstring).

    RMSNorm is torch's unfused composite, which computes in fp32 whatever e is: it keeps the fp32
    input (an upcast copy below fp32) and the fp32 normalised value. CPU's LayerNorm keeps its mean
    and rstd in the (bf16) parameters' dtype, CUDA's in fp32."""
    sb, h, e = a.tokens * a.micro_batch_size, cfg.hidden_size, a.dtype_bytes
    if cfg.arch == "gpt2":
        stat = e if a.device == "cpu" else 4
        return (sb * h * e + 2 * sb * stat) // a.shard
    return sb * (2 * h + 1) * 4 // a.shard


def _attention_core_bytes(cfg: ModelConfig, a: ActivationSpec) -> dict[str, int]:
    """Everything attention keeps between its qkv and out projections."""
    s, b, t, e = a.tokens, a.micro_batch_size, a.tp, a.dtype_bytes
    n, g, d = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    qkv_out = s * b * (n + 2 * g) * d * e // t
    tables = 2 * s * d * 4 if cfg.arch == "llama" else 0  # RoPE's fp32 cos/sin
    rope = s * b * (n + g) * d * e // t + tables if cfg.arch == "llama" else 0
    out = s * b * n * d * e // t
    if a.recompute == "selective":
        return {"qkv_out": qkv_out, "rope": rope, "attn_out": out}
    if a.cp > 1:
        return cp_core_bytes(cfg, a)
    if a.attention_kernel(cfg) == "flash":
        # With GQA or normed q the kernel's output is laid out so the out-projection copies it (measured);
        # per-document calls write into one output (doc_blocks.document_attention).
        copies = 2 if g < n or cfg.qk_layernorm else 1
        return {"qkv_out": qkv_out, "rope": rope, "lse": b * n * s * 4 // t, "attn_out": out * copies}
    # The math kernel computes in fp32: below fp32 its q, k, v are upcast copies, and its matrices fp32.
    expanded = s * b * n * d * 4 // t
    keeps_view = g == n and e == 4  # only fp32 MHA's v is the qkv output's view; else a copy (GQA: expanded)
    v_term = {"qkv_out": qkv_out} if keeps_view else {"v_expanded": expanded}
    return {"q_scaled": expanded, "k_expanded": expanded, **v_term, "rope_tables": tables,
            "scores": 3 * b * n * square_sum(s, a.document_length) * 4 // t, "attn_out": out}


def _head_norm_terms(cfg: ModelConfig, a: ActivationSpec, core: dict[str, int]) -> dict[str, int]:
    """--qk-layernorm: what the per-head RMSNorms of q and k keep beyond the attention ``core`` terms (module
    docstring). fp32 has no upcast, so the norms save their inputs, views of the qkv output, themselves."""
    if not cfg.qk_layernorm:
        return {}
    s, b, t, e, d = a.tokens, a.micro_batch_size, a.tp, a.dtype_bytes, cfg.head_dim
    n, g = cfg.num_attention_heads, cfg.query_groups
    heads = s * b * (n + g) // t  # rows normalised: every q and k head of every token
    inputs = heads * d * 4 if e != 4 else (s * b * n * d * 4 // t if g < n else 0)
    terms = {"qk_norms": heads * (d + 1) * 4 + inputs}
    if e == 4 and "qkv_out" not in core:
        terms["qkv_out"] = s * b * (n + 2 * g) * d * e // t
    return terms


def kv_heads_per_rank(cfg: ModelConfig, a: ActivationSpec) -> int:
    """kv heads per rank in the attention core: g / t, replicated to lcm(g / t, U) for an all-to-all of U."""
    g = cfg.query_groups // a.tp
    u = a.cp_a2a if a.cp_comm_type != "p2p" else 1
    return g if g % u == 0 else math.lcm(g, u)


def cp_core_bytes(cfg: ModelConfig, a: ActivationSpec, width: int | None = None) -> dict[str, int]:
    """What the CP attention core keeps for backward (see the module docstring); ``width``: the heads' width
    when not ``cfg.head_dim`` (MLA's padded W, ``mla_activations.py``)."""
    s, b, t, e = a.tokens, a.micro_batch_size, a.tp, a.dtype_bytes
    n, d = cfg.num_attention_heads, width or cfg.head_dim
    out = s * b * n * d * e // t
    tables = 2 * s * d * 4 if cfg.arch == "llama" else 0  # RoPE cos/sin at this rank's positions
    # ring: contiguous copies of this rank's q, k, v; all-to-all: q, k, v gathered to n/U heads of U x s tokens
    qkv = s * b * (n // t + 2 * kv_heads_per_rank(cfg, a)) * d * e
    terms = {"qkv": qkv, "rope": tables, "lse": b * n * s * 4 // t, "attn_out": 2 * out}
    if a.cp_comm_type == "a2a" and a.document_length is not None:  # documents that travel: ulysses_docs
        shared = a2a_shared_tokens(s * a.cp, min(a.document_length, s * a.cp), a.cp)
        w, wk = n // t // a.cp, kv_heads_per_rank(cfg, a) // a.cp
        terms["shared_documents"] = b * shared * ((2 * w + 2 * wk) * d * e + w * 4)
    return terms


def cp_working_bytes(cfg: ModelConfig, a: ActivationSpec) -> int:
    """Transient of the CP attention core while one layer's attention runs (module docstring): the
    ring's K/V buffers and fp32 dK/dV/dQ accumulators; the all-to-alls' gathered gradients and buffers."""
    if a.cp == 1:
        return 0
    s, b, t, e = a.tokens, a.micro_batch_size, a.tp, a.dtype_bytes
    n, d = cfg.num_attention_heads, core_width(cfg) if cfg.multi_latent_attention else cfg.head_dim
    gathered = s * b * (n // t + 2 * kv_heads_per_rank(cfg, a)) * d * e  # dq, dk, dv of the gathered heads
    total = gathered + 2 * s * b * n * d * e // t if a.cp_comm_type != "p2p" else 0
    if a.cp_comm_type != "a2a":
        kv = 2 * s * b * kv_heads_per_rank(cfg, a) * d  # K and V of one block, elements
        total += 2 * kv * e + 3 * kv * 4 + s * b * n * d * 4 // t
    return total


def layer_terms(cfg: ModelConfig, a: ActivationSpec) -> dict[str, int]:
    """Saved bytes of one block for one micro-batch, by term (see the module docstring)."""
    s, b, h, f, t, e = (a.tokens, a.micro_batch_size, cfg.hidden_size, cfg.ffn_size, a.tp, a.dtype_bytes)
    if a.recompute == "full":
        return {"block_input": s * b * h * e // a.shard}
    # The qkv and MLP-in layers keep their (normed) input; llama's gate and up share one. Under SP
    # they keep only the local sequence shard and re-gather it in backward.
    terms = {"norms": 2 * _norm_bytes(cfg, a), "linear_inputs": 2 * s * b * h * e // a.shard}
    if cfg.multi_latent_attention:  # its own attention terms (mla_activations.py); no per-head q/k norms
        terms.update(mla_layer_terms(cfg, a, cp_core_bytes(cfg, a, core_width(cfg)) if a.cp > 1 else None))
    else:
        terms.update(_attention_core_bytes(cfg, a))
        terms.update(_head_norm_terms(cfg, a, terms))
    terms["mlp"] = (4 if cfg.arch == "llama" else 2) * s * b * f * e // t
    if a.training and cfg.hidden_dropout > 0:
        terms["dropout_masks"] = 2 * s * b * h * a.mask_bytes() // a.shard
    return terms


def first_stage_terms(cfg: ModelConfig, a: ActivationSpec) -> dict[str, int]:
    sb = a.tokens * a.micro_batch_size
    # Without TP or CP the ids saved are a view of the micro-batch's [b, s + 1] tokens: b x 8 bytes more
    ids = sb * 8 + (a.micro_batch_size * 8 if a.cp == 1 and a.tp == 1 else 0)
    terms = {"token_ids": ids + (sb if a.tp > 1 else 0)}
    if a.cp > 1 and cfg.arch == "gpt2":
        terms["position_index"] = a.tokens * 8  # the learned table is indexed at this rank's positions
    if a.training and cfg.hidden_dropout > 0:
        terms["embedding_dropout"] = sb * cfg.hidden_size * a.mask_bytes() // a.shard
    return terms


def last_stage_terms(cfg: ModelConfig, a: ActivationSpec) -> dict[str, int]:
    sb, rows = a.tokens * a.micro_batch_size, cfg.padded_vocab_size(a.tp) // a.tp
    if a.ce_chunk_size > 0:  # the fused head keeps its gradients, computed in forward: dh (sequence shard), fp32 dW
        return {"final_norm": _norm_bytes(cfg, a), "head_grad_input": sb * cfg.hidden_size * a.dtype_bytes // a.shard,
                "head_grad_weight_fp32": rows * cfg.hidden_size * 4}
    return {"final_norm": _norm_bytes(cfg, a), "head_input": sb * cfg.hidden_size * a.dtype_bytes // a.shard,
            "softmax_fp32": sb * rows * 4, "targets": sb * 9}


def mtp_terms(cfg: ModelConfig, a: ActivationSpec, blocks_before: int = 0,
              recompute_num_layers: int | None = None) -> dict[str, int]:
    """What the D multi-token-prediction depths (``model/mtp.py``) keep on the last stage per micro-batch.

    Per depth: its block as a main layer at this recompute mode (full recompute checkpoints it when the chunk's
    first ``recompute_num_layers`` blocks reach it, the ``blocks_before`` main blocks first), the shifted token
    ids (s b 8, + s b for the TP>1 mask), enorm and hnorm (RMSNorm; in fp32 hnorm's input is the tensor the
    previous final norm keeps, counted once), eh_proj's input [s, b, 2h] (SP: the local shard), and one more
    head as ``last_stage_terms`` counts the main one, plus its fp32 target mask (s b 4)."""
    if not cfg.mtp_depth:
        return {}
    sb, h, e, r = a.tokens * a.micro_batch_size, cfg.hidden_size, a.dtype_bytes, a.shard
    plain = ActivationSpec(**{**a.__dict__, "recompute": "none"})
    blocks = 0
    for k in range(1, cfg.mtp_depth + 1):
        kept = a.recompute == "full" and recompute_num_layers is not None and recompute_num_layers < blocks_before + k
        blocks += sum(layer_terms(cfg, plain if kept else a).values())
    shared_input = sb * h * 4 // r if e == 4 else 0
    inputs = sb * 8 + (sb if a.tp > 1 else 0) + 2 * _norm_bytes(cfg, a) - shared_input + 2 * sb * h * e // r
    heads = sum(last_stage_terms(cfg, a).values()) + sb * 4
    return {"mtp_blocks": blocks, "mtp_inputs": cfg.mtp_depth * inputs, "mtp_heads": cfg.mtp_depth * heads}


def head_working_bytes(cfg: ModelConfig, a: ActivationSpec) -> int:
    """Transient of the head and loss on the last stage, beyond what ``last_stage_terms`` keeps.

    Plain path: the logits [tokens, V/t] and, unless they are fp32, the fp32 result of
    ``logits - max`` that is copied into the softmax buffer (kept, so in ``last_stage_terms``).
    Fused (``tensor_parallel/fused_cross_entropy.py``): one chunk of c tokens at a time: its
    logits, which in fp32 are the softmax buffer too, else that buffer and the fp32 temporary
    (measured: c V/t (e + 8)); later, in bf16/fp16, the softmax's cast for the GEMMs next to the
    [V/t, h] product added into the fp32 dW; with sequence parallelism also the gathered input
    and the full dh before its reduce-scatter (2 s b h e).
    """
    sb, rows, e = a.tokens * a.micro_batch_size, cfg.padded_vocab_size(a.tp) // a.tp, a.dtype_bytes
    fp32_copy = 4 if e != 4 else 0
    if a.ce_chunk_size <= 0:
        return sb * rows * (e + fp32_copy)
    chunk = min(a.ce_chunk_size, sb) * rows
    working = max(chunk * (e + 2 * fp32_copy), chunk * e + rows * cfg.hidden_size * e if fp32_copy else 0)
    return working + (2 * sb * cfg.hidden_size * e if a.shard > 1 else 0)


def chunk_activation_bytes(cfg: ModelConfig, a: ActivationSpec, num_blocks: int, pre_process: bool,
                           post_process: bool, recompute_num_layers: int | None = None) -> int:
    """Saved bytes of one micro-batch through one model chunk of ``num_blocks`` blocks.

    With full recompute, only the first ``recompute_num_layers`` blocks (all when None)
    are checkpointed; the rest keep everything.
    """
    per_layer = sum(layer_terms(cfg, a).values())
    total = num_blocks * per_layer
    if a.recompute == "full" and recompute_num_layers is not None:
        kept = max(0, num_blocks - recompute_num_layers)
        plain = ActivationSpec(**{**a.__dict__, "recompute": "none"})
        total = (num_blocks - kept) * per_layer + kept * sum(layer_terms(cfg, plain).values())
    if pre_process:
        total += sum(first_stage_terms(cfg, a).values())
    if post_process:  # the head, and the MTP depths after the chunk's blocks
        total += sum(last_stage_terms(cfg, a).values())
        total += sum(mtp_terms(cfg, a, num_blocks, recompute_num_layers).values())
    return total


def recompute_working_bytes(cfg: ModelConfig, a: ActivationSpec) -> int:
    """Transient during backward with full recompute: one block's activations rebuilt at a time."""
    if a.recompute != "full":
        return 0
    return sum(layer_terms(cfg, ActivationSpec(**{**a.__dict__, "recompute": "none"})).values())


def in_flight_micro_batches(schedule: str, pp: int, stage: int, num_micro_batches: int, vp: int = 1) -> int:
    """Micro-batches (chunk-forwards for interleaved) whose activations a stage holds at its peak.

    pp = 1: one (each micro-batch's backward runs before the next forward). GPipe: all m.
    1F1B: pp - stage, capped at m (the first stage holds the most). Interleaved
    (Megatron): warm-up (pp - stage - 1) * 2 + (vp - 1) * pp, plus one, capped at m * vp
    chunk-forwards, each of L / (pp * vp) layers.
    """
    m = num_micro_batches
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m * vp
    if schedule == "interleaved" and vp > 1:
        return min(m * vp, (pp - stage - 1) * 2 + (vp - 1) * pp + 1)
    return min(m, pp - stage)
