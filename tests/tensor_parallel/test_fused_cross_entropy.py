"""The fused, chunked head + vocab-parallel cross entropy equals the plain head then loss (fp32).

Reference paths: ``column_parallel_linear`` then ``vocab_parallel_cross_entropy`` (today's
path), and ``F.cross_entropy`` on the full logits of the real vocabulary. Tolerance 1e-6
relative to the largest entry: only the order of the sums differs (per chunk, and the
1/tokens applied after the GEMMs instead of before). Chunk sizes that divide the token
count, that do not, and that exceed it; padded vocabulary columns, and (at tp 2) a rank
whose whole slice is padding.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from megazero.config import Config
from megazero.model.documents import PackingRule
from megazero.parallel.state import ParallelState
from megazero.pipeline.partition import build_chunks
from megazero.run_plan import RunPlan
from megazero.tensor_parallel.comm import _split
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from megazero.tensor_parallel.layers import column_parallel_linear
from tests.helpers.compare import rel_err
from tests.helpers.dist import spawn
from tests.helpers.launch import train_records
from tests.helpers.peak_memory import peak_allocated_bytes
from tests.helpers.saved_tensors import SavedTensorMeter

S, B, H, PADDED = 8, 6, 32, 128  # 48 tokens; the head has 128 rows (padded vocabulary)
TOL = 1e-6


def _inputs(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states [s, b, h], the head weight [padded, h] (padding rows zero) and targets [s, b]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=g)
    weight = torch.randn(PADDED, H, generator=g) * 0.5
    weight[vocab:] = 0.0
    target = torch.randint(0, vocab, (S, B), generator=g)
    return x, weight, target


def _grads(loss_fn, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Loss and its gradients w.r.t. (x, weight), with a grad_output != 1 (as loss scaling gives)."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(x, weight)
    (2.5 * loss).backward()
    return loss.detach(), x.grad, weight.grad


def _plain(vocab: int, target: torch.Tensor):
    """Today's path, serial: the head GEMM, then the vocab-parallel loss."""
    return lambda x, w: vocab_parallel_cross_entropy(column_parallel_linear(x, w, None, None, False), target,
                                                     None, vocab).mean()


def _fused(vocab: int, chunk: int, target: torch.Tensor, group=None, sp: bool = False,
           weights: torch.Tensor | None = None):
    return lambda x, w: fused_linear_cross_entropy(x, w, target, group, vocab_size=vocab, chunk_size=chunk,
                                                   sequence_parallel=sp, token_weights=weights)


def _plain_weighted(vocab: int, target: torch.Tensor, weights: torch.Tensor):
    """The masked loss's unfused path: the sum of the token losses, each times its weight."""
    return lambda x, w: (vocab_parallel_cross_entropy(column_parallel_linear(x, w, None, None, False), target,
                                                      None, vocab) * weights).sum()


def _mask(seed: int = 3) -> torch.Tensor:
    """A 0/1 token mask [s, b] as --eod-mask-loss makes (about a quarter of the tokens dropped)."""
    return (torch.rand(S, B, generator=torch.Generator().manual_seed(seed)) > 0.25).float()


@pytest.mark.parametrize("chunk", [1, 7, 16, 48, 100])
def test_single_process_matches_plain_path_and_torch(chunk):
    vocab = 100
    x, weight, target = _inputs(vocab)
    plain = _plain(vocab, target)
    torch_ref = lambda x, w: F.cross_entropy((x @ w[:vocab].t()).reshape(-1, vocab), target.reshape(-1))  # noqa: E731
    fused = _grads(_fused(vocab, chunk, target), x, weight)
    for name, ref in (("plain", _grads(plain, x, weight)), ("torch", _grads(torch_ref, x, weight))):
        for what, a, e in zip(("loss", "dx", "dW"), fused, ref):
            assert rel_err(a, e) <= TOL, f"chunk {chunk} vs {name}: {what} off by {rel_err(a, e):.2e}"
    assert fused[2][vocab:].abs().max() == 0, "padded rows must get no gradient"


@pytest.mark.parametrize("chunk", [7, 48])
def test_token_weights_match_the_weighted_sum_of_plain_and_torch_losses(chunk):
    """--eod-mask-loss through the fused head: the weighted sum of token losses and its gradients."""
    vocab, mask = 100, _mask()
    x, weight, target = _inputs(vocab)
    torch_ref = lambda x, w: (F.cross_entropy((x @ w[:vocab].t()).reshape(-1, vocab), target.reshape(-1),  # noqa: E731
                                              reduction="none") * mask.reshape(-1)).sum()
    fused = _grads(_fused(vocab, chunk, target, weights=mask), x, weight)
    for name, ref in (("plain", _grads(_plain_weighted(vocab, target, mask), x, weight)),
                      ("torch", _grads(torch_ref, x, weight))):
        for what, a, e in zip(("loss", "dx", "dW"), fused, ref):
            assert rel_err(a, e) <= TOL, f"chunk {chunk} vs {name}: {what} off by {rel_err(a, e):.2e}"


def test_flag_builds_a_model_with_the_same_loss_and_grads():
    """--cross-entropy-chunk-size reaches the model (through build_chunks) and changes neither loss nor any
    parameter gradient (llama: untied head)."""
    settings = dict(vocab_size=300, arch="llama", num_layers=1, hidden_size=32, num_attention_heads=4,
                    seq_length=16, seed=5)
    tokens = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(1))
    pstate = ParallelState.serial()
    results = []
    for chunk in (0, 10):
        cfg = Config.from_flat({**settings, "cross_entropy_chunk_size": chunk})
        model = build_chunks(cfg, RunPlan.resolve(cfg, 1), pstate)[0]
        loss = model(tokens[:, :-1], tokens[:, 1:])
        assert ("Fused" in type(loss.grad_fn).__name__) == (chunk > 0), type(loss.grad_fn).__name__
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert rel_err(loss_b, loss_a) <= TOL
    assert grads_a.keys() == grads_b.keys() and "output.weight" in grads_b
    for name in grads_a:
        assert rel_err(grads_b[name], grads_a[name]) <= TOL, f"d{name}: {rel_err(grads_b[name], grads_a[name]):.2e}"


def test_eod_mask_loss_with_the_flag_keeps_the_masked_loss_and_grads():
    """--eod-mask-loss with --cross-entropy-chunk-size (once refused): the model's masked loss through the fused
    head equals the unfused one, loss and every gradient (gpt2: the head is the tied embedding)."""
    settings = dict(vocab_size=300, arch="gpt2", num_layers=1, hidden_size=32, num_attention_heads=4,
                    seq_length=16, seed=5, eod_mask_loss=True)
    tokens = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(1))
    tokens[:, [3, 9, 10]] = 7  # end-of-document tokens: no loss where they are the input
    documents = PackingRule(eod_id=7, eod_mask_loss=True).documents(tokens[:, :-1])
    results = []
    for chunk in (0, 10):
        cfg = Config.from_flat({**settings, "cross_entropy_chunk_size": chunk})
        model = build_chunks(cfg, RunPlan.resolve(cfg, 1), ParallelState.serial())[0]
        loss = model(tokens[:, :-1], tokens[:, 1:], documents=documents)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert rel_err(loss_b, loss_a) <= TOL
    for name in grads_a:
        assert rel_err(grads_b[name], grads_a[name]) <= TOL, f"d{name}: {rel_err(grads_b[name], grads_a[name]):.2e}"


def _check_tp(pstate) -> dict[str, float]:
    """Fused at tp 2 (with and without sequence parallelism) against the serial plain path."""
    group, rank = pstate.tp_group, pstate.tp_rank
    errs = {}
    for vocab in (100, 60):  # 60: rank 1's whole slice (rows 64-127) is padding
        x, weight, target = _inputs(vocab, seed=vocab)
        plain = _plain(vocab, target)
        ref_loss, ref_dx, ref_dw = _grads(plain, x, weight)
        for sp in (False, True):
            for chunk in (7, 48):
                x_in = _split(x, 0, group) if sp else x
                loss, dx, dw = _grads(_fused(vocab, chunk, target, group, sp), x_in, _split(weight, 0, group))
                key = f"vocab={vocab}.sp={sp}.chunk={chunk}"
                errs[f"{key}.loss"] = rel_err(loss, ref_loss)
                errs[f"{key}.dx"] = rel_err(dx, _split(ref_dx, 0, group) if sp else ref_dx)
                errs[f"{key}.dW"] = rel_err(dw, ref_dw[rank * 64:(rank + 1) * 64]) if rank * 64 < vocab else \
                    float(dw.abs().max())
            mask = _mask(seed=vocab)  # token weights (--eod-mask-loss) at tp 2, with and without SP
            want_loss, want_dx, _ = _grads(_plain_weighted(vocab, target, mask), x, weight)
            x_in = _split(x, 0, group) if sp else x
            loss, dx, _ = _grads(_fused(vocab, 7, target, group, sp, mask), x_in, _split(weight, 0, group))
            errs[f"weighted.vocab={vocab}.sp={sp}.loss"] = rel_err(loss, want_loss)
            errs[f"weighted.vocab={vocab}.sp={sp}.dx"] = rel_err(dx, _split(want_dx, 0, group) if sp else want_dx)
    return errs


def test_tp2_matches_serial():
    for rank, errs in enumerate(spawn(_check_tp, 2, tp=2)):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_memory_falls_by_the_fp32_logits():
    """Saved bytes, and the peak bytes of the head's forward + backward, with and without chunking."""
    s, b, h, padded, vocab, chunk = 64, 4, 32, 512, 500, 32
    g = torch.Generator().manual_seed(0)
    x0, target = torch.randn(s, b, h, generator=g), torch.randint(0, vocab, (s, b), generator=g)
    weight = torch.nn.Parameter(torch.randn(padded, h, generator=g))
    logits_bytes = s * b * padded * 4

    def run(fused: bool) -> int:
        """Forward + backward of the head and loss; the bytes saved for backward."""
        weight.grad = None
        x = x0.clone().requires_grad_()
        with SavedTensorMeter([weight]) as meter:
            if fused:
                loss = fused_linear_cross_entropy(x, weight, target, None, vocab_size=vocab, chunk_size=chunk)
            else:
                loss = vocab_parallel_cross_entropy(column_parallel_linear(x, weight, None, None, False),
                                                    target, None, vocab).mean()
        loss.backward()
        return meter.bytes

    saved_plain, saved_fused = run(False), run(True)
    peak_plain, peak_fused = peak_allocated_bytes(lambda: run(False)), peak_allocated_bytes(lambda: run(True))
    grad_w_bytes = padded * h * 4  # the fused forward holds dW, which the plain path allocates in backward
    print(json.dumps({"logits_fp32_bytes": logits_bytes, "saved_plain": saved_plain, "saved_fused": saved_fused,
                      "peak_plain": peak_plain, "peak_fused": peak_fused}))
    assert saved_plain - saved_fused >= logits_bytes - grad_w_bytes
    assert peak_plain - peak_fused >= logits_bytes, (peak_plain, peak_fused, logits_bytes)


SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "1",
         "--lr", "1e-3"]


def _losses(tmp_path, name: str, nproc: int, extra: list[str]) -> list[float]:
    return [r["loss"] for r in train_records(tmp_path / f"{name}.jsonl", [*SMALL, *extra], nproc)]


def test_pretrain_losses_unchanged_by_the_flag(tmp_path):
    """gpt2 (tied head: the word embedding's weight): one process, and tp 2 with sequence parallelism."""
    plain = _losses(tmp_path, "plain", 1, [])
    fused = _losses(tmp_path, "fused", 1, ["--cross-entropy-chunk-size", "40"])
    assert len(plain) == 4 and len(fused) == 4
    for it, (a, b) in enumerate(zip(fused, plain), start=1):
        assert abs(a - b) <= TOL * abs(b), f"iteration {it}: fused {a} vs plain {b}"
    tp2 = _losses(tmp_path, "fused_tp2_sp", 2, ["--tp", "2", "--sequence-parallel", "--cross-entropy-chunk-size", "40"])
    for it, (a, b) in enumerate(zip(tp2, plain), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"iteration {it}: fused tp 2 sp {a} vs plain tp 1 {b}"
