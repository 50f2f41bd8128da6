"""A plain-torch GPT-2 with the weights of megazero's serial model, for the tensor-parallel peers.

Same math as ``megazero.model.gpt.GPTModel`` (gpt2 arch): learned positions,
pre-norm blocks, fused QKV laid out head by head as [q, k, v] (megazero's
group-by-group layout with one head per group), tanh-GELU MLP, tied
embedding, mean token cross-entropy. Activations are [b, s, h]. The linear
layers are built by a ``linear(kind, in, out)`` factory so a peer can swap in
its tensor-parallel layers; ``kind`` is "column" (qkv, fc1) or "row" (proj, fc2).
A column layer returns [..., out/tp], a row layer takes [..., in/tp] and
returns the full, reduced output.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Linear = Callable[[str, int, int], nn.Module]


def plain_linear(kind: str, n_in: int, n_out: int) -> nn.Module:
    return nn.Linear(n_in, n_out)


class Block(nn.Module):
    def __init__(self, h: int, heads: int, linear: Linear, eps: float) -> None:
        super().__init__()
        self.head_dim = h // heads
        self.norm1, self.norm2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.qkv, self.proj = linear("column", h, 3 * h), linear("row", h, h)
        self.fc1, self.fc2 = linear("column", h, 4 * h), linear("row", 4 * h, h)

    def attention(self, x_bsh: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x_bsh)  # [b, s, n_local * 3 * d]
        b, s, _ = qkv.shape
        qkv_bnxsd = qkv.view(b, s, -1, 3, self.head_dim).permute(0, 2, 3, 1, 4)
        q, k, v = qkv_bnxsd[:, :, 0], qkv_bnxsd[:, :, 1], qkv_bnxsd[:, :, 2]
        out_bnsd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out_bnsd.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """Blocks only; the embedding and the tied head/loss are supplied by the peer (they differ under TP)."""

    def __init__(self, cfg, linear: Linear = plain_linear) -> None:
        super().__init__()
        self.position = nn.Embedding(cfg.position_table_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg.hidden_size, cfg.num_attention_heads, linear, cfg.norm_epsilon)
                                    for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)

    def body(self, x_bsh: torch.Tensor) -> torch.Tensor:
        """Embedded tokens [b, s, h] (without positions) -> final-normed hidden states [b, s, h]."""
        x = x_bsh + self.position.weight[: x_bsh.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)


# megazero parameter name -> plain parameter name, per block
BLOCK_NAMES = {"norm1.weight": "norm1.weight", "norm1.bias": "norm1.bias", "norm2.weight": "norm2.weight",
               "norm2.bias": "norm2.bias", "attention.qkv.weight": "qkv.weight", "attention.qkv.bias": "qkv.bias",
               "attention.proj.weight": "proj.weight", "attention.proj.bias": "proj.bias",
               "mlp.fc1.weight": "fc1.weight", "mlp.fc1.bias": "fc1.bias", "mlp.fc2.weight": "fc2.weight",
               "mlp.fc2.bias": "fc2.bias"}
SPLIT = {"qkv.weight": 0, "qkv.bias": 0, "fc1.weight": 0, "fc1.bias": 0, "proj.weight": 1, "fc2.weight": 1,
         "word.weight": 0}


def megazero_weights(serial: nn.Module) -> dict[str, torch.Tensor]:
    """The serial megazero model's weights under plain names (``word.weight`` is the tied embedding)."""
    sd = serial.state_dict()
    out = {"word.weight": sd["embedding.word.weight"], "position.weight": sd["embedding.position.weight"],
           "final_norm.weight": sd["final_norm.weight"], "final_norm.bias": sd["final_norm.bias"]}
    for i in range(len(serial.layers)):
        for mz, plain in BLOCK_NAMES.items():
            out[f"layers.{i}.{plain}"] = sd[f"layers.{i}.{mz}"]
    return out


def local_slice(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's contiguous slice of ``full`` (whole heads for qkv), or all of it if replicated."""
    dim = SPLIT.get(name.split(".", 2)[-1] if name.startswith("layers.") else name)
    return full if dim is None else full.chunk(size, dim=dim)[rank].clone()
