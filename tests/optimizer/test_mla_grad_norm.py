"""The grad norm counts MLA's replicated projections and latent norms exactly once under TP (issue 43).

Under tp 2 the heads and up-projections split while the down-projections (``q_down``, ``kv_down``) and the
latent RMSNorms (``q_norm``, ``kv_norm``) are replicated on both TP ranks (ROCm TE #715 counted such copies
tp times). Every parameter k of the full model gets the gradient 2^k in every element; each rank writes its
TP slice into its main grads (with SP, the replicated ones as 2^k / tp partial sums, which the engine sums
over TP) and calls the real ``step()``. The expected norm is the one-process sum
numel_k x 4^k, computed exactly with fractions and asserted representable in fp64, so the comparison is ==:
counting any replicated parameter twice (or a split one once) adds or drops numel_k x 4^k and changes the bits.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest

from megazero.parallel.state import ParallelState
from megazero.tensor_parallel.layers import spec_of
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import build, make_cfg

MLA = dict(arch="llama", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, vocab_size=64)
REPLICATED = ("q_down", "q_norm", "kv_down", "kv_norm")


def norm_at(pstate: ParallelState, tp: int, sp: bool) -> dict:
    """step()'s norm with gradient 2^k on parameter k; the full shapes and which parameters were replicated."""
    cfg = make_cfg(zero=1, tp=tp, sp=sp, layers=1, hidden=32).updated(**MLA)
    model = build(pstate, cfg)
    opt = model.optimizer
    opt.zero_grad()
    full_shapes, replicated = [], []
    for chunk in model.chunks:
        for k, (name, p) in enumerate(chunk.named_parameters()):
            dim = spec_of(p).split_dim
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= pstate.tp
            else:
                replicated.append(name)
            full_shapes.append((name, shape))
            # SP: each TP rank holds a partial sum (its half of the sequence) that the engine sums over TP
            partial = pstate.tp if spec_of(p).sequence_parallel else 1
            p.main_grad.fill_(2.0 ** k / partial)
    return {"norm": opt.step(0.0).grad_norm, "shapes": full_shapes, "replicated": replicated}


def exact_norm(shapes: list[tuple[str, list[int]]]) -> float:
    total = sum(Fraction(math.prod(shape)) * 4 ** k for k, (_, shape) in enumerate(shapes))
    assert Fraction(float(total)) == total, "the sum of squares must be exact in fp64 for == to be fair"
    return math.sqrt(float(total))


def test_serial_norm_is_the_exact_sum():
    out = norm_at(ParallelState.serial(), 1, False)
    assert out["norm"] == exact_norm(out["shapes"])


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2.sp"])
def test_tp2_counts_replicated_latent_weights_once(sp):
    serial = norm_at(ParallelState.serial(), 1, False)
    results = spawn(norm_at, 2, 2, sp, tp=2)
    want = exact_norm(results[0]["shapes"])  # the vocabulary pads to a multiple of tp: the whole shapes of tp 2
    for rank, r in enumerate(results):
        assert [n for n, _ in r["shapes"]] == [n for n, _ in serial["shapes"]], rank
        blocks = [(n, s) for n, s in r["shapes"] if n.startswith("layers.")]  # all but the padded vocab rows
        assert blocks == [(n, s) for n, s in serial["shapes"] if n.startswith("layers.")], rank
        assert all(any(key in n for n in r["replicated"]) for key in REPLICATED), r["replicated"]
        assert r["norm"] == want, (rank, r["norm"], want)
