"""DeepSeek-V3 hub-weight helpers against transformers' own interleaved RoPE and a tensor quantised here."""
import math

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

from megazero.checkpoint.hf_deepseek import (
    dequantize_fp8_blockwise,
    halves_to_interleaved,
    interleaved_to_halves,
    permute_rope_rows,
)
from megazero.model.rope import apply_rotary


def _cos_sin(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def test_rope_permutation_makes_rotate_half_equal_transformers_interleave():
    torch.manual_seed(0)
    b, n, s, d = 2, 3, 5, 8
    q, k = torch.randn(b, n, s, d), torch.randn(b, n, s, d)
    cos, sin = _cos_sin(s, d)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q, k, cos[None], sin[None])
    order = interleaved_to_halves(d)
    assert torch.allclose(apply_rotary(q[..., order], cos, sin), hf_q, atol=1e-6)
    assert torch.allclose(apply_rotary(k[..., order], cos, sin), hf_k, atol=1e-6)
    assert not torch.allclose(apply_rotary(q, cos, sin), hf_q, atol=1e-3)  # the permutation is needed


def test_permute_rope_rows_roundtrip_and_only_touches_rope_rows():
    torch.manual_seed(0)
    heads, nope, rope = 3, 4, 6
    w = torch.randn(heads * (nope + rope), 7)
    imported = permute_rope_rows(w, nope + rope, nope, rope, interleaved_to_halves(rope))
    back = permute_rope_rows(imported, nope + rope, nope, rope, halves_to_interleaved(rope))
    assert torch.equal(back, w)
    per_head, src = imported.view(heads, nope + rope, 7), w.view(heads, nope + rope, 7)
    assert torch.equal(per_head[:, :nope], src[:, :nope])
    assert torch.equal(per_head[:, nope:], src[:, nope:][:, interleaved_to_halves(rope)])


@pytest.mark.parametrize("shape", [(128, 256), (200, 130), (5, 300)])
def test_fp8_blockwise_dequant_recovers_a_tensor_quantised_here(shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    blocks = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    scale_inv = torch.empty(blocks)
    q = torch.empty(shape, dtype=torch.float8_e4m3fn)
    for i in range(blocks[0]):
        for j in range(blocks[1]):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale_inv[i, j] = tile.abs().max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (tile / scale_inv[i, j]).to(torch.float8_e4m3fn)
    out = dequantize_fp8_blockwise(q, scale_inv)
    tile0 = out[:128, :128]
    assert torch.equal(tile0, q[:128, :128].float() * scale_inv[0, 0])
    assert torch.allclose(out, w, rtol=0.07, atol=1e-2)  # e4m3 keeps 3 mantissa bits


def test_fp8_dequant_refuses_a_mismatched_scale():
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        dequantize_fp8_blockwise(torch.zeros(200, 130, dtype=torch.float8_e4m3fn), torch.ones(1, 2))
