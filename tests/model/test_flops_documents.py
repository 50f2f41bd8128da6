"""TFLOP/s and MFU under --reset-attention-mask count the (query, key) pairs the document mask leaves."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megazero.arguments import parse_config
from megazero.config import ModelConfig
from megazero.context_parallel.doc_blocks import ring_runs
from megazero.data import MicroBatchIterator, build_data
from megazero.model.documents import attended_pairs, attended_share, document_bounds
from megazero.model.flops import flops_per_token
from tests.helpers.launch import train_records

EOD = 0


def _mask(bounds_row: tuple[int, ...]) -> torch.Tensor:
    """The block-diagonal causal mask [S, S] of one sample, built entry by entry."""
    seq = bounds_row[-1]
    doc = torch.zeros(seq, dtype=torch.long)
    for d, (s, e) in enumerate(zip(bounds_row[:-1], bounds_row[1:])):
        doc[s:e] = d
    return (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()


def _packed(seq: int, samples: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (samples, seq), generator=gen)
    tokens[torch.rand(samples, seq, generator=gen) < 0.15] = EOD  # documents of every length, some of one token
    return tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attended_pairs_are_the_masks_true_entries(seed: int) -> None:
    bounds = document_bounds(_packed(24, 3, seed), EOD)
    assert any(len(cuts) > 3 for cuts in bounds), "the samples must pack several documents"
    assert attended_pairs(bounds) == sum(int(_mask(cuts).sum()) for cuts in bounds)


@pytest.mark.parametrize("size", [2, 4])
def test_ring_rank_pairs_are_its_query_rows_of_the_mask(size: int) -> None:
    """Under the ring a rank counts the mask's True entries in the rows of the query chunks it holds."""
    bounds = document_bounds(_packed(32, 2, 7), EOD)
    local = 32 // size
    counts = []
    for rank in range(size):
        rows = [torch.arange(g, g + n) for _, g, n in ring_runs(rank, size, local)]
        brute = sum(int(_mask(cuts)[torch.cat(rows)].sum()) for cuts in bounds)
        counts.append(attended_pairs(bounds, (rank, size)))
        assert counts[-1] == brute
    assert sum(counts) == attended_pairs(bounds)


def test_share_scales_only_the_attention_core() -> None:
    cfg = ModelConfig(arch="gpt2", num_layers=1, hidden_size=4, num_attention_heads=2, ffn_hidden_size=16,
                      seq_length=8, vocab_size=10)
    # the hand count of test_flops_lr: forward 592 of which scores + mix 128; causal pairs of S=8: 36
    bounds = ((0, 3, 8),)  # documents of 3 and 5 tokens: 6 + 15 = 21 pairs
    share = attended_share([bounds])
    assert share == 21 / 36
    assert flops_per_token(cfg, attended_share=share) == pytest.approx(3 * (592 - 128 + 128 * 21 / 36))
    assert flops_per_token(cfg, attended_share=attended_share([((0, 8),)])) == flops_per_token(cfg)
    assert flops_per_token(cfg, "selective", attended_share=share) == pytest.approx(
        3 * (592 - 128 + 128 * 21 / 36) + 128 * 21 / 36)


RUN = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
       "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
       "--log-interval", "1", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-interval", "0"]


def _step_shares(args: list[str]) -> tuple[list[float], ModelConfig]:
    """Each step's attended share, from the boundaries of the batches the run reads (the same data build),
    and the run's model (its vocabulary is the default tokenizer's)."""
    cfg, _ = parse_config(args)
    t = cfg.training
    data = build_data(data_path=None, tokenizer_model=None, split=cfg.data.split, seq_length=cfg.model.seq_length,
                      train_samples=t.train_iters * t.global_batch_size, eval_samples=0, seed=t.seed,
                      is_builder=True, log=lambda _: None)
    batches = MicroBatchIterator(data.train, t.micro_batch_size, t.global_batch_size // t.micro_batch_size, 0, 1)
    eod = data.tokenizer.eos_id
    shares = [attended_share([document_bounds(mb[:, :-1], eod) for mb in batches.next_step()])
              for _ in range(t.train_iters)]
    return shares, dataclasses.replace(cfg.model, vocab_size=data.tokenizer.vocab_size)


def _step_flops(record: dict) -> float:
    """FLOPs per device the record claims for its step (TFLOP/s x seconds: independent of the timing)."""
    return record["tflops_per_device"] * 1e12 * record["step_time_ms"] / 1000


def test_pretrain_reports_the_masked_flops(tmp_path) -> None:
    full = train_records(tmp_path / "full.jsonl", RUN, 1, default_corpus=True)
    masked = train_records(tmp_path / "masked.jsonl", [*RUN, "--reset-attention-mask"], 1, default_corpus=True)
    shares, model = _step_shares(RUN)
    assert min(shares) < 0.9, f"the default corpus's samples must pack several documents: {shares}"
    tokens = 4 * 128
    for off, on, share in zip(full, masked, shares, strict=True):
        assert _step_flops(off) == pytest.approx(flops_per_token(model) * tokens, rel=1e-9)  # today's formula
        expected = flops_per_token(model, attended_share=share) / flops_per_token(model)
        assert _step_flops(on) / _step_flops(off) == pytest.approx(expected, rel=1e-9)
        assert _step_flops(on) < _step_flops(off)
