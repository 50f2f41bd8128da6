"""A plain-torch GPT-2 / Llama with the weights of megazero's serial model, for the tensor-parallel peers.

Same math as ``megazero.model.gpt.GPTModel``. gpt2: learned positions, LayerNorm,
tanh-GELU MLP, biases, tied embedding. llama: rotate-half RoPE, RMSNorm, SwiGLU
(fc2(silu(gate) * fc1)), no biases, grouped-query attention, untied head. Blocks are
pre-norm; the fused QKV is laid out group by group, [q heads of group 0, k0, v0, ...]
(megazero's layout), so a contiguous TP slice holds whole groups. Activations are
[b, s, h]; the loss is the mean token cross-entropy. The linear layers are built by a
``linear(kind, in, out, bias)`` factory so a peer can swap in its tensor-parallel layers;
``kind`` is "column" (qkv, fc1, gate) or "row" (proj, fc2). A column layer returns
[..., out/tp], a row layer takes [..., in/tp] and returns the full, reduced output.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Linear = Callable[[str, int, int, bool], nn.Module]


def plain_linear(kind: str, n_in: int, n_out: int, bias: bool) -> nn.Module:
    return nn.Linear(n_in, n_out, bias=bias)


def rope_tables(cfg, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [s, d] of rotate-half RoPE at positions 0..s-1, computed once per forward (as Megatron does)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, cfg, linear: Linear) -> None:
        super().__init__()
        h, self.llama = cfg.hidden_size, cfg.arch == "llama"
        self.head_dim, self.per_group = cfg.head_dim, cfg.num_attention_heads // cfg.query_groups
        norm = (lambda: nn.RMSNorm(h, eps=cfg.norm_epsilon)) if self.llama else (
            lambda: nn.LayerNorm(h, eps=cfg.norm_epsilon))
        bias = not self.llama
        self.norm1, self.norm2 = norm(), norm()
        qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
        self.qkv = linear("column", h, qkv, bias)
        self.proj = linear("row", cfg.num_attention_heads * cfg.head_dim, h, bias)
        self.fc1, self.fc2 = linear("column", h, cfg.ffn_size, bias), linear("row", cfg.ffn_size, h, bias)
        if self.llama:
            self.gate = linear("column", h, cfg.ffn_size, bias)

    def attention(self, x_bsh: torch.Tensor, rope) -> torch.Tensor:
        qkv = self.qkv(x_bsh)  # [b, s, g_local * x * d]
        b, s, _ = qkv.shape
        qkv_bgxsd = qkv.view(b, s, -1, self.per_group + 2, self.head_dim).permute(0, 2, 3, 1, 4)
        q = qkv_bgxsd[:, :, :self.per_group].reshape(b, -1, s, self.head_dim)
        k, v = qkv_bgxsd[:, :, -2], qkv_bgxsd[:, :, -1]
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        out_bnsd = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.per_group > 1)
        return self.proj(out_bnsd.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), rope)
        y = self.norm2(x)
        if self.llama:
            return x + self.fc2(F.silu(self.gate(y)) * self.fc1(y))
        return x + self.fc2(F.gelu(self.fc1(y), approximate="tanh"))


class PlainGPT(nn.Module):
    """Blocks only; the embedding and the head/loss are supplied by the peer (they differ under TP)."""

    def __init__(self, cfg, linear: Linear = plain_linear) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.arch == "gpt2":
            self.position = nn.Embedding(cfg.position_table_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, linear) for _ in range(cfg.num_layers))
        self.final_norm = (nn.RMSNorm if cfg.arch == "llama" else nn.LayerNorm)(cfg.hidden_size, eps=cfg.norm_epsilon)

    def body(self, x_bsh: torch.Tensor) -> torch.Tensor:
        """Embedded tokens [b, s, h] (without positions) -> final-normed hidden states [b, s, h]."""
        rope = None
        if self.cfg.arch == "gpt2":
            x_bsh = x_bsh + self.position.weight[: x_bsh.shape[1]]
        else:
            rope = rope_tables(self.cfg, x_bsh.shape[1])
        for layer in self.layers:
            x_bsh = layer(x_bsh, rope)
        return self.final_norm(x_bsh)


# megazero parameter name -> plain parameter name, per block
BLOCK_NAMES = {"norm1.weight": "norm1.weight", "norm1.bias": "norm1.bias", "norm2.weight": "norm2.weight",
               "norm2.bias": "norm2.bias", "attention.qkv.weight": "qkv.weight", "attention.qkv.bias": "qkv.bias",
               "attention.proj.weight": "proj.weight", "attention.proj.bias": "proj.bias",
               "mlp.fc1.weight": "fc1.weight", "mlp.fc1.bias": "fc1.bias", "mlp.fc2.weight": "fc2.weight",
               "mlp.fc2.bias": "fc2.bias", "mlp.gate.weight": "gate.weight"}
SPLIT = {"qkv.weight": 0, "qkv.bias": 0, "fc1.weight": 0, "fc1.bias": 0, "gate.weight": 0, "proj.weight": 1,
         "fc2.weight": 1, "word.weight": 0, "output.weight": 0}
TOP_NAMES = {"embedding.word.weight": "word.weight", "embedding.position.weight": "position.weight",
             "final_norm.weight": "final_norm.weight", "final_norm.bias": "final_norm.bias",
             "output.weight": "output.weight"}


def megazero_weights(serial: nn.Module) -> dict[str, torch.Tensor]:
    """The serial megazero model's weights under plain names (``word.weight`` is the embedding)."""
    sd = serial.state_dict()
    out = {plain: sd[mz] for mz, plain in TOP_NAMES.items() if mz in sd}
    for i in range(len(serial.layers)):
        for mz, plain in BLOCK_NAMES.items():
            if f"layers.{i}.{mz}" in sd:
                out[f"layers.{i}.{plain}"] = sd[f"layers.{i}.{mz}"]
    return out


def local_slice(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's contiguous slice of ``full`` (whole groups for qkv), or all of it if replicated."""
    dim = SPLIT.get(name.split(".", 2)[-1] if name.startswith("layers.") else name)
    return full if dim is None else full.chunk(size, dim=dim)[rank].clone()
