"""The attention kernel a run uses is PyTorch's own choice, and pretrain_gpt.py says which, once."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megazero.config import ModelConfig
from megazero.model.sdpa import describe_attention, sdpa_backend
from tests.helpers.launch import launch

LLAMA = ModelConfig(arch="llama", num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    vocab_size=128)


def _attend(backend: SDPBackend | None, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 64, 16, generator=g, dtype=dtype)
    kv = torch.randn(1, 2, 64, 16, generator=g, dtype=dtype)
    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)


def test_reported_backend_is_the_one_sdpa_runs():
    """On CPU the flash kernel (GQA included) in fp32 and bf16: the default call equals the forced one bitwise
    and differs from the math kernel, so the report names what actually ran."""
    for dtype in (torch.float32, torch.bfloat16):
        assert sdpa_backend(LLAMA, dtype, torch.device("cpu"), 4, 2) == "FLASH_ATTENTION", dtype
        default = _attend(None, dtype)
        assert torch.equal(default, _attend(SDPBackend.FLASH_ATTENTION, dtype))
        assert not torch.equal(default, _attend(SDPBackend.MATH, dtype))
    dropout = LLAMA.__class__(**{**LLAMA.__dict__, "attention_dropout": 0.1})
    assert sdpa_backend(dropout, torch.float32, torch.device("cpu"), 4, 2) == "MATH"
    assert "attention dropout rules out flash" in describe_attention(dropout, torch.float32, torch.device("cpu"),
                                                                     1, 1, "p2p")


def test_pretrain_prints_the_backend_once():
    flags = ["--arch", "llama", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "1"]
    ranks = launch("pretrain_gpt.py", flags, 2)
    assert all(r.returncode == 0 for r in ranks), ranks[0].stderr[-2000:]
    lines = [line for r in ranks for line in r.stdout.splitlines() if "attention: SDPA" in line]
    assert lines == ["megazero: attention: SDPA FLASH_ATTENTION on cpu (fp32, 4 heads / 2 kv heads per rank)"], lines
