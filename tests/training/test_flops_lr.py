"""The achieved-FLOPs formula against a hand count, and the LR schedule against closed forms."""
from __future__ import annotations

import math

import pytest

from megazero.config import ModelConfig, OptimizerConfig
from megazero.optimizer.lr import LRSchedule
from megazero.model.flops import flops_per_token
from megazero.training.flops import achieved_tflops


def test_flops_per_token_hand_count():
    # gpt2, h=4, 2 heads of d=2, MLP 16, s=8, V=10, one layer. Per token, forward:
    #   QKV 2*4*(2+2*2)*2 = 96, scores+mix 2 * (2*8*2*2) = 128, out proj 2*4*4 = 32,
    #   MLP 2 matmuls * 2*4*16 = 256  -> layer 512; head 2*4*10 = 80 -> forward 592.
    cfg = ModelConfig(arch="gpt2", num_layers=1, hidden_size=4, num_attention_heads=2, ffn_hidden_size=16,
                      seq_length=8, vocab_size=10)
    assert flops_per_token(cfg) == 3 * 592
    assert flops_per_token(cfg, "selective") == 3 * 592 + 128
    assert flops_per_token(cfg, "full") == 3 * 592 + 512
    # llama with 2 query groups of 2 heads (h=8, n=4, g=2, d=2; RoPE needs an even d): QKV 2*8*(4+4)*2 = 256,
    # core 2*(2*8*4*2) = 256, out 2*4*2*8 = 128, SwiGLU 3 * 2*8*16 = 768 -> 1408; head 2*8*10 = 160.
    llama = ModelConfig(arch="llama", num_layers=1, hidden_size=8, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=16, seq_length=8, vocab_size=10)
    assert flops_per_token(llama) == 3 * (1408 + 160)
    assert achieved_tflops(1e12, 10, 2.0, 5) == pytest.approx(1.0)


def _schedule(style: str, **kw) -> LRSchedule:
    return LRSchedule(OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style=style, **kw),
                      train_iters=110)


def test_lr_schedules_closed_form():
    cos = _schedule("cosine")
    assert cos(5) == pytest.approx(0.5)  # warm-up: lr * 5/10
    assert cos(10) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(110) == pytest.approx(0.1) and cos(500) == pytest.approx(0.1)
    lin = _schedule("linear")
    assert lin(35) == pytest.approx(0.1 + 0.9 * (1 - 25 / 100))
    assert _schedule("constant")(90) == pytest.approx(1.0)
    wsd = _schedule("wsd", lr_wsd_decay_fraction=0.2)
    assert wsd(80) == pytest.approx(1.0)  # stable phase until 80% of decay
    assert wsd(100) == pytest.approx(0.1 + 0.9 * (1 - 0.9) / 0.2)
    frac = LRSchedule(OptimizerConfig(lr=1.0, lr_warmup_fraction=0.1, lr_decay_style="constant"), train_iters=200)
    assert frac.warmup_iters == 20 and frac(10) == pytest.approx(0.5)
