"""The context-parallel block kernel on CUDA: fused attention that returns the log-sum-exp.

A ring (or a document-masked ring) computes attention one K/V block at a time and merges the
partial outputs by their LSE, so each block needs (out, lse) and a backward from the final (out,
lse). On CUDA ``blocks.block_forward`` / ``block_backward`` run flash attention (bf16, fp16) or the
memory-efficient kernel (fp32) instead of the math version. Checked here, on a GPU:

- each block's (out, lse) and (dq, dk, dv) equal the CPU result of the same block (CPU flash in
  fp32 on the same inputs), causal and dense, with and without GQA;
- the ops that ran are the fused ones (profiler), not matmuls;
- a sequence cut into query and K/V chunks as a 2-rank load-balanced ring cuts it, every block
  computed separately and merged by LSE, with the backward from the merged (out, lse), equals
  causal SDPA's output and autograd gradients over the whole sequence.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megazero.context_parallel.blocks import block_backward, block_forward, merge

pytestmark = pytest.mark.cuda
FUSED = {torch.bfloat16: "aten::_scaled_dot_product_flash_attention",
         torch.float16: "aten::_scaled_dot_product_flash_attention",
         torch.float32: "aten::_scaled_dot_product_efficient_attention"}
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-5}


def _qkv(dtype: torch.dtype, heads: int, groups: int, sq: int, sk: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, sq, 64, generator=gen)
    k, v = (torch.randn(2, groups, sk, 64, generator=gen) for _ in range(2))
    return [t.to(dtype) for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("groups", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_block_matches_cpu(dtype: torch.dtype, groups: int, causal: bool) -> None:
    sq, sk = (96, 96) if causal else (80, 112)  # 80 rows: the efficient kernel pads its LSE to 96
    q, k, v = _qkv(dtype, 4, groups, sq, sk)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    cpu = [t.float() for t in (q, k, v)]
    out_ref, lse_ref = block_forward(*cpu, causal)
    grads_ref = block_backward(dout.float(), *cpu, out_ref, lse_ref, causal)
    gpu = [t.cuda() for t in (q, k, v)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out, lse = block_forward(*gpu, causal)
        grads = block_backward(dout.cuda(), *gpu, out, lse, causal)
    ops = {e.key for e in prof.key_averages()}
    assert FUSED[dtype] in ops and FUSED[dtype] + "_backward" in ops, sorted(o for o in ops if "attention" in o)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), out_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu(), lse_ref, atol=tol, rtol=tol)
    for got, want in zip(grads, grads_ref):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ring_blocks_merge_to_causal_attention(dtype: torch.dtype) -> None:
    """Rank 0 of a 2-rank balanced ring holds chunks 0 and 3 of 4; every (query chunk, key chunk) pair it
    computes, merged, plus the same for rank 1, is whole-sequence causal attention."""
    s, c = 256, 64
    q, k, v = (t.cuda() for t in _qkv(dtype, 4, 2, s, s, seed=3))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype).cuda()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    want.backward(dout.float())
    out = torch.empty_like(q, dtype=torch.float32)
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    rows = lambda t, i: t[:, :, i * c:(i + 1) * c]  # noqa: E731 - chunk i of the sequence
    for qi in range(4):
        blocks = [(ki, ki == qi) for ki in range(qi + 1)]
        partial, lse = None, None
        for ki, causal in blocks:
            out_b, lse_b = block_forward(rows(q, qi), rows(k, ki), rows(v, ki), causal)
            partial, lse = (out_b.float(), lse_b) if partial is None else merge(partial, lse, out_b.float(), lse_b)
        rows(out, qi).copy_(partial)
        for ki, causal in blocks:
            g = block_backward(rows(dout, qi), rows(q, qi), rows(k, ki), rows(v, ki), partial.to(dtype), lse, causal)
            rows(dq, qi).add_(g[0])
            rows(dk, ki).add_(g[1])
            rows(dv, ki).add_(g[2])
    tol = TOL[dtype]
    torch.testing.assert_close(out, want.detach(), atol=tol, rtol=tol)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, atol=4 * tol, rtol=4 * tol)
