"""One block of attention (a slice of queries against a slice of keys) with its log-sum-exp, and the merge.

Ring attention computes softmax(QK^T)V one K/V block at a time, so each block must also return the
log-sum-exp (LSE) of its scaled scores: two partial outputs of the same queries combine exactly as

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

in fp32 (fp64 for fp64 inputs). A row that saw no key has lse = -inf and out = 0; the merge keeps
that NaN-free (weights of such a row are 0, never exp(-inf - -inf)).

The backward of a block needs only the *final* output and LSE of its rows: with P = exp(S - lse) the
block's share of the softmax, dS = P * (dO V^T - rowsum(dO * O)), so each block's dQ/dK/dV are
independent and simply add up.

Kernels: on CPU, torch's flash-attention op (blocked, never materialises S x S, handles GQA and
fp32/fp64/bf16); on CUDA, the fused kernels that return the LSE and take it back in their backward -
flash attention for bf16/fp16, memory-efficient attention for fp32 (kv heads repeated for GQA, their
gradients summed back); elsewhere,
and for any dtype or head size they refuse (fp64 on CUDA), a plain math version (matmuls and an fp32
softmax). Shapes: q [b, n, sq, d], k/v [b, g, sk, d] with n a multiple of g (q head h uses kv head
h // (n/g)), lse [b, n, sq].
"""
from __future__ import annotations

import torch

_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where partial outputs and gradients add up: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _use_flash(q: torch.Tensor, force_math: bool) -> bool:
    return not force_math and q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES


def _cuda_kernel(q: torch.Tensor, force_math: bool) -> str | None:
    """The fused CUDA kernel for this block: "flash" (bf16/fp16), "efficient" (fp32), or None (math: fp64)."""
    if force_math or q.device.type != "cuda" or q.shape[-1] % 8 or q.shape[-1] > 256:
        return None
    return {torch.bfloat16: "flash", torch.float16: "flash", torch.float32: "efficient"}.get(q.dtype)


def _lse_rows(sq: int) -> int:
    """The memory-efficient kernel pads its LSE rows to a multiple of 32; its backward reads them so."""
    return -(-sq // 32) * 32


def _cuda_forward(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, sq = q.shape[1], q.shape[2]
    q, k, v = q.contiguous(), _expand_kv(k, n).contiguous(), _expand_kv(v, n).contiguous()
    if kind == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse[..., :sq].float().contiguous()


def _cuda_backward(kind: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, n, sq, d = q.shape
    g, sk = k.shape[1], k.shape[2]
    q, kx, vx = q.contiguous(), _expand_kv(k, n).contiguous(), _expand_kv(v, n).contiguous()
    dout, out, lse = dout.contiguous(), out.to(q.dtype).contiguous(), lse.float().contiguous()
    if kind == "flash":  # dense, no dropout: no varlen offsets and no RNG state to hand back
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, kx, vx, out, lse, None, None, sq, sk, 0.0, causal, None, None)
    else:
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)  # dropout 0: the kernel draws nothing
        padded = lse.new_zeros(b, n, _lse_rows(sq))
        padded[..., :sq] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, kx, vx, None, out, padded, no_rng, no_rng, 0.0, (True, True, True, False), causal)
    if g != n:  # repeated kv heads: each kv head's gradient is the sum over its query heads
        dk, dv = dk.view(b, g, n // g, sk, d).sum(2), dv.view(b, g, n // g, sk, d).sum(2)
    acc = acc_dtype(q.dtype)
    return dq.to(acc), dk.to(acc), dv.to(acc)


def _expand_kv(t_bgsd: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads repeated so head h of the result is kv head h // (heads / g) (as SDPA's enable_gqa)."""
    g = t_bgsd.shape[1]
    return t_bgsd if g == heads else t_bgsd.repeat_interleave(heads // g, dim=1)


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """True where query i may see key j; queries are the last sq of sk positions (diagonal blocks: sq = sk)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


def math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) by matmuls in the accumulation dtype; ``mask`` (bool, True = keep) overrides ``causal``."""
    acc = acc_dtype(q.dtype)
    n, sq, sk, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    scores = torch.matmul(q.to(acc), _expand_kv(k, n).to(acc).transpose(-1, -2)) * d ** -0.5
    if causal and mask is None:
        mask = _causal_mask(sq, sk, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))  # rows with lse = -inf: exp(-inf) = 0, not NaN
    out = torch.matmul(probs, _expand_kv(v, n).to(acc))
    return out.to(q.dtype), lse


def math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's (dq, dk, dv) given the rows' final ``out`` and ``lse``; in the accumulation dtype."""
    acc = acc_dtype(q.dtype)
    b, n, sq, d = q.shape
    g, sk = k.shape[1], k.shape[2]
    scale = d ** -0.5
    q_, k_, v_, do_ = q.to(acc), _expand_kv(k, n).to(acc), _expand_kv(v, n).to(acc), dout.to(acc)
    scores = torch.matmul(q_, k_.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~_causal_mask(sq, sk, q.device), float("-inf"))
    probs = torch.exp(scores - _finite(lse.to(acc)).unsqueeze(-1))
    delta = (do_ * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
    dscores = probs * (torch.matmul(do_, v_.transpose(-1, -2)) - delta) * scale
    dq = torch.matmul(dscores, k_)
    dk = torch.matmul(dscores.transpose(-1, -2), q_).view(b, g, n // g, sk, d).sum(2)
    dv = torch.matmul(probs.transpose(-1, -2), do_).view(b, g, n // g, sk, d).sum(2)
    return dq, dk, dv


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  force_math: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse in the accumulation dtype [b, n, sq], contiguous)."""
    if _use_flash(q, force_math):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse.to(acc_dtype(q.dtype)).contiguous()
    kind = _cuda_kernel(q, force_math)
    if kind is not None:
        return _cuda_forward(kind, q, k, v, causal)
    return math_forward(q, k, v, causal)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool,
                   force_math: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's (dq, dk, dv), each to be added in the accumulation dtype. The CPU kernel reads strided
    dout and out (a document's rows of a larger tensor) as given: no copies (bitwise the same results)."""
    if _use_flash(q, force_math):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(acc_dtype(q.dtype)).contiguous(), 0.0, causal)
    kind = _cuda_kernel(q, force_math)
    if kind is not None:
        return _cuda_backward(kind, dout, q, k, v, out, lse, causal)
    return math_backward(dout, q, k, v, out, lse, causal)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that saw no key) replaced by 0, to subtract without making NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial results of the same rows (out [.., s, d] in the accumulation dtype, lse [.., s])."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = _finite(lse)
    w_a = torch.exp(lse_a - base).unsqueeze(-1)
    w_b = torch.exp(lse_b - base).unsqueeze(-1)
    out_b = out_b.masked_fill(torch.isneginf(lse_b).unsqueeze(-1), 0.0)  # a fully masked block adds exactly 0
    return out_a * w_a + out_b.to(out_a.dtype) * w_b, lse
