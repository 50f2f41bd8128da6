"""One transformer block for both families, built from tensor-parallel layers.

Legend: s sequence, b batch, h hidden, n heads on this rank, g query groups
(key/value heads) on this rank, x = heads per group + 2 (its q heads, k, v),
d head dim. Activations between blocks are [s, b, h] ([s/tp, b, h] with
sequence parallelism).

The fused QKV weight is laid out group by group - [q heads of group 0, k0,
v0, q heads of group 1, ...] - so a contiguous TP slice holds whole groups
and the full (TP=1) layout does not depend on the TP size.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..config import ModelConfig
from ..context_parallel import CPContext
from ..context_parallel.doc_blocks import Bounds
from ..context_parallel.logit_max import LogitMax
from ..moe.context import ExpertContext
from ..moe.layer import MoELayer
from ..parallel.collectives import CommLedger
from ..parallel.state import group_size
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_init_std, set_spec
from ..tensor_parallel.random import DropoutRNG, stream_name
from .documents import Documents
from .kv_cache import KVCache, cached_attention
from .mla import MLA
from .recompute import checkpointed_block, checkpointed_core
from .rope import apply_rotary, rotary_cos_sin, rotary_inv_freq  # noqa: F401 (rotary_inv_freq: its old home)
from .sdpa import core_attention


@dataclass
class TPContext:
    """What a block needs to know about tensor (and context) parallelism."""

    group: object = None  # the TP process group; None for TP=1
    sequence_parallel: bool = False
    rng: DropoutRNG | None = None  # None: dropout draws from the default generator
    cp: CPContext = CPContext()  # the sequence split over ranks; inactive at cp 1
    experts: ExpertContext = ExpertContext()  # the expert grid's groups, for MoE layers; all size 1 by default

    def positions(self, local_tokens: int, device: torch.device | str,
                  documents: Documents | None = None) -> torch.Tensor:
        """Positions of this rank's ``local_tokens`` tokens of a sample (all of them at cp 1): global [s], or
        per sample [b, s] when ``documents`` restart them (already cut to this rank by ``Documents.local``)."""
        if documents is not None and documents.positions is not None:
            return documents.positions
        split = self.cp.split
        return split.positions(local_tokens * split.cp, self.cp.rank, device)

    @property
    def tp(self) -> int:
        """The TP degree (the size of ``group``)."""
        return group_size(self.group)

    def dropout_streams(self, layer: int | str) -> list[str]:
        """Every stream ``layer`` draws from (what recompute must rewind)."""
        return [stream_name(layer, tensor_parallel=False), stream_name(layer, tensor_parallel=True)]

    def fork_rng(self, layer: int | str, tensor_parallel: bool) -> contextlib.AbstractContextManager:
        """Draw from ``layer``'s shared stream, or its per-TP-rank one inside a TP region."""
        if self.rng is None:
            return contextlib.nullcontext()
        return self.rng.fork(stream_name(layer, tensor_parallel))


def hidden_dropout(x: torch.Tensor, p: float, ctx: TPContext, layer: int | str) -> torch.Tensor:
    """Dropout on block/embedding outputs: SP shards differ across TP ranks, replicated activations match.

    Under context parallelism the mask is drawn for the whole sequence and each rank keeps its tokens'
    rows, so a token's mask depends on its global position, not on --cp.
    """
    with ctx.fork_rng(layer, tensor_parallel=ctx.sequence_parallel):
        if not ctx.cp.active:
            return F.dropout(x, p)
        whole = F.dropout(x.new_ones((x.shape[0] * ctx.cp.size, *x.shape[1:])), p)
        return x * ctx.cp.split.take(whole, 0, ctx.cp.rank)


def make_norm(cfg: ModelConfig, ctx: TPContext) -> nn.Module:
    """LayerNorm (gpt2) or RMSNorm (llama); replicated, with SP-partial grads under sequence parallelism."""
    if cfg.arch == "gpt2":
        norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
    else:
        norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
    for name, p in norm.named_parameters():
        set_spec(p, sequence_parallel=ctx.sequence_parallel, init_value=1.0 if name == "weight" else 0.0)
    return norm


def make_head_norm(cfg: ModelConfig) -> nn.Module:
    """--qk-layernorm: RMSNorm over each query or key head's d features (Qwen3's q_norm/k_norm), else identity.

    TP ranks hold different heads but one shared weight, so each rank's weight gradient is a partial sum
    over its heads: marked like a sequence-parallel norm, the engine sums it over TP with those.
    """
    if not cfg.qk_layernorm:
        return nn.Identity()
    norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_epsilon)
    set_spec(norm.weight, sequence_parallel=True, init_value=1.0)
    return norm


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: TPContext, layer_id: int = 0) -> None:
        super().__init__()
        self.cfg, self.ctx, self.layer_id = cfg, ctx, layer_id
        self.heads_per_group = cfg.num_attention_heads // cfg.query_groups
        qkv_features = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
        bias = cfg.arch == "gpt2"
        self.qkv = ColumnParallelLinear(cfg.hidden_size, qkv_features, tp_group=ctx.group, bias=bias,
                                        sequence_parallel=ctx.sequence_parallel, init_std=cfg.init_method_std)
        self.proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, tp_group=ctx.group,
                                      bias=bias, sequence_parallel=ctx.sequence_parallel,
                                      init_std=scaled_init_std(cfg.init_method_std, cfg.num_layers))
        self.q_norm, self.k_norm = make_head_norm(cfg), make_head_norm(cfg)
        self.recompute_core = False  # selective recompute (``recompute.apply_recompute``): checkpoint the core
        self.core_eager = False  # --compile: the core is a graph break (``compile.eager_sites``)
        self.logit_max: LogitMax | None = None  # --qk-clip-threshold: the core adds its per-head max logit here

    def extra_repr(self) -> str:
        return ", ".join(w for w, on in (("recompute=selective", self.recompute_core),
                                          ("core eager", self.core_eager)) if on)

    def attend(self, q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor,
               bounds: Bounds | None = None) -> torch.Tensor:
        """The core, checkpointed under selective recompute while grad is on."""
        if self.recompute_core and torch.is_grad_enabled():
            return checkpointed_core(self, self.core_attention, q_bnsd, k_bgsd, v_bgsd, bounds)
        return self.core_attention(q_bnsd, k_bgsd, v_bgsd, bounds)

    core_attention = core_attention  # ``sdpa.core_attention``: the one core, shared with MLA

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """``cache`` (decoding only): the new tokens follow the cached ones, attend to them, and are cached.
        ``documents`` (packed samples, this rank's cut): positions that restart, attention kept in documents."""
        qkv = self.qkv(x)  # [s, b, g * x * d]
        qkv_bgxsd = rearrange(qkv, "s b (g x d) -> b g x s d", x=self.heads_per_group + 2, d=self.cfg.head_dim)
        q_bnsd = self.q_norm(rearrange(qkv_bgxsd[:, :, :self.heads_per_group], "b g x s d -> b (g x) s d"))
        k_bgsd, v_bgsd = self.k_norm(qkv_bgxsd[:, :, -2]), qkv_bgxsd[:, :, -1]
        if self.cfg.arch == "llama":
            new_tokens = q_bnsd.shape[2]
            positions = (self.ctx.positions(new_tokens, x.device, documents) if cache is None
                         else cache.positions(new_tokens, x.device))
            cos, sin = rotary_cos_sin(positions, self.cfg)
            q_bnsd, k_bgsd = apply_rotary(q_bnsd, cos, sin), apply_rotary(k_bgsd, cos, sin)
        if cache is None:
            bounds = None if documents is None else documents.bounds
            attend = EAGER["attend"] if self.core_eager else Attention.attend
            out_bnsd = attend(self, q_bnsd, k_bgsd, v_bgsd, bounds)
        else:
            out_bnsd = cached_attention(q_bnsd, *cache.update(self.layer_id, k_bgsd, v_bgsd))
        return self.proj(rearrange(out_bnsd, "b n s d -> s b (n d)"))


class MLP(nn.Module):
    """gpt2: fc1 -> GELU(tanh) -> fc2. llama: down(silu(gate) * up)."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext) -> None:
        super().__init__()
        self.gated = cfg.arch == "llama"
        bias = not self.gated
        column = dict(tp_group=ctx.group, bias=bias, sequence_parallel=ctx.sequence_parallel,
                      init_std=cfg.init_method_std)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, **column)
        if self.gated:
            self.gate = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, **column)
        self.fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, tp_group=ctx.group, bias=bias,
                                     sequence_parallel=ctx.sequence_parallel,
                                     init_std=scaled_init_std(cfg.init_method_std, cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.fc2(F.silu(self.gate(x)) * self.fc1(x))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)).

    ``layer_id`` is the global layer index: it names the dropout streams the block draws from, and
    ``cfg.is_moe_layer`` says whether its MLP is a mixture of experts (``moe.layer.MoELayer``) or dense.
    """

    def __init__(self, cfg: ModelConfig, ctx: TPContext, layer_id: int = 0) -> None:
        super().__init__()
        self.cfg, self.ctx, self.layer_id = cfg, ctx, layer_id
        self.norm1 = make_norm(cfg, ctx)
        self.attention: Attention | MLA = (MLA if cfg.multi_latent_attention else Attention)(cfg, ctx, layer_id)
        self.norm2 = make_norm(cfg, ctx)
        self.mlp: MLP | MoELayer = MoELayer(cfg, ctx.experts, layer_id) if cfg.is_moe_layer(layer_id) else MLP(cfg, ctx)
        self.recompute = "none"  # ``recompute.apply_recompute``: "full" checkpoints this block (its compiled body)
        self.compiled_body: Callable[..., torch.Tensor] | None = None  # --compile: ``compile.compile_block``
        self.dropout_eager = False  # --compile: the drawing dropout is a graph break (``compile.eager_sites``)
        self.mlp_eager = False  # --compile: the MoE layer is a graph break (``compile.eager_sites``)
        self.zero3_unit: int | None = None  # --zero 3: the unit gathering this block (``data_parallel/zero3.py``)

    def extra_repr(self) -> str:
        """What ``training/parallelize.py`` applied, as ``print(model)`` shows it."""
        applied = [f"layer {self.layer_id}", f"recompute={self.recompute}"]
        if self.compiled_body is not None:
            eager = [f"{what} eager" for what, on in (("dropout", self.dropout_eager), ("moe", self.mlp_eager)) if on]
            applied.append(", ".join(["compiled", *eager]))
        if self.zero3_unit is not None:
            applied.append(f"zero3 unit {self.zero3_unit}")
        return ", ".join(applied)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.cfg.hidden_dropout == 0.0:
            return x
        return hidden_dropout(x, self.cfg.hidden_dropout, self.ctx, self.layer_id)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """The body (compiled under --compile), checkpointed whole under full recompute while grad is on."""
        body = self.compiled_body or self.body
        if self.recompute == "full" and cache is None and torch.is_grad_enabled():
            return checkpointed_block(self, body, x, documents)
        return body(x, cache=cache, documents=documents)

    def body(self, x: torch.Tensor, cache: KVCache | None = None,
             documents: Documents | None = None) -> torch.Tensor:
        dropout = EAGER["dropout"] if self.dropout_eager else TransformerBlock._dropout
        mlp = EAGER["mlp"] if self.mlp_eager else TransformerBlock._mlp
        x = x + dropout(self, self.attention(self.norm1(x), cache=cache, documents=documents))
        return x + dropout(self, mlp(self, self.norm2(x)))


# --compile's graph breaks (``compile.eager_sites``): the same code, run eager from inside a compiled body. Made
# when a block is compiled: torch.compiler.disable imports torch._dynamo (~1.7 s of CPU per process), which a run
# without --compile never needs.
EAGER: dict[str, Callable] = {}


def make_eager_sites() -> None:
    """Fill ``EAGER`` (once per process) before a block's body is compiled."""
    if not EAGER:
        CommLedger.keep_out_of_compile()
        EAGER.update(attend=torch.compiler.disable(Attention.attend, recursive=True),
                     dropout=torch.compiler.disable(TransformerBlock._dropout, recursive=True),
                     mlp=torch.compiler.disable(TransformerBlock._mlp, recursive=True))
