"""MoE balance records and aux-loss-free balancing, through ``pretrain_gpt.py`` runs of a tiny MoE GPT on CPU.

- The force-balance router gives max/mean tokens per expert exactly 1 (imbalance 0) in the metrics file,
  with the counts summed over both sequence-parallel ranks and each layer's row from its pipeline stage
  (tp 2 x pp 2); the step's FLOPs are the active-parameter formula.
- dp 2 with full recompute routes and counts as one process without it: per-layer counts equal every step
  (both replicas' tokens, a recompute's not again), and so do the expert biases they update.
- A router skewed toward two experts (+1.0 on their choice scores, written into a checkpoint's expert bias:
  every token picks them at the start) is balanced by the bias updates to imbalance <= 0.15 within 100 steps.
"""
from __future__ import annotations

import glob

import pytest
import torch
from safetensors.torch import load_file, save_file

from megazero.arguments import parse_config
from megazero.model.flops import flops_per_token
from megazero.training.metrics import format_moe
from tests.helpers.launch import train_records

EXPERTS, TOPK = 4, 2
MOE = ["--arch", "gpt2", "--num-layers", "2", "--num-attention-heads", "2", "--lr-warmup-iters", "1",
       "--eval-interval", "0", "--log-interval", "1", "--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK),
       "--moe-ffn-hidden-size", "32"]
SMALL = [*MOE, "--hidden-size", "32", "--seq-length", "64", "--micro-batch-size", "4", "--lr", "1e-3"]


def _step_flops(record: dict) -> float:
    """FLOPs per device the record claims for its step (TFLOP/s x seconds: independent of the timing)."""
    return record["tflops_per_device"] * 1e12 * record["step_time_ms"] / 1000


def _check_flops(records: list[dict], folder, world: int) -> None:
    """Every step's FLOPs equal the formula of the run's own resolved configuration (config.yaml)."""
    cfg, _ = parse_config(["--config", str(folder / "config.yaml")])
    t = cfg.training
    tokens = t.global_batch_size * cfg.model.seq_length
    expected = flops_per_token(cfg.model, t.recompute, t.recompute_num_layers) * tokens
    assert all(_step_flops(r) * world == pytest.approx(expected, rel=1e-9) for r in records)


def _counts(record: dict) -> dict[str, list[int]]:
    return {layer: v["tokens_per_expert"] for layer, v in record["moe_layers"].items()}


def test_force_balance_records_exact_balance_and_active_flops(tmp_path) -> None:
    args = [*SMALL, "--global-batch-size", "8", "--train-iters", "2", "--tp", "2", "--sequence-parallel",
            "--pp", "2", "--moe-router-force-balance"]
    records = train_records(tmp_path / "fb.jsonl", args, 4)
    assignments = 8 * 64 * TOPK  # the global batch's tokens, k experts each
    for r in records:
        assert r["moe_imbalance"] == 0.0
        for layer in ("0", "1"):
            counts = r["moe_layers"][layer]["tokens_per_expert"]
            assert counts == [assignments // EXPERTS] * EXPERTS  # both TP ranks' halves, from both stages
            assert max(counts) / (sum(counts) / EXPERTS) == 1.0
    _check_flops(records, tmp_path, 4)


def _model_file(checkpoint) -> str:
    """The glob of the saved model tensors (tp 0, pp 0: every router of a pp 1 run)."""
    return str(checkpoint / "iter_*" / "model_tp00_pp00.safetensors")


def _saved_expert_bias(checkpoint) -> dict[str, torch.Tensor]:
    (path,) = glob.glob(_model_file(checkpoint))
    return {name: t for name, t in load_file(path).items() if name.endswith("router.expert_bias")}


def test_counts_cover_every_rank_once(tmp_path) -> None:
    """dp 2 with full recompute against one process without: the same global counts every step (each replica's
    tokens counted, a recompute's not), so the same expert-bias updates, and bitwise the same saved biases."""
    args = [*SMALL, "--global-batch-size", "16", "--train-iters", "3", "--moe-aux-loss-coeff", "1e-2",
            "--moe-z-loss-coeff", "1e-3", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2"]
    runs = {"serial": ([], 1), "dp2_full": (["--recompute", "full"], 2)}
    records = {}
    for name, (extra, world) in runs.items():
        (tmp_path / name).mkdir()
        records[name] = train_records(tmp_path / name / "m.jsonl",
                                      [*args, *extra, "--save", str(tmp_path / name / "ckpt")], world)
        _check_flops(records[name], tmp_path / name, world)
    for a, b in zip(records["serial"], records["dp2_full"], strict=True):
        assert _counts(a) == _counts(b)
        assert all(sum(c) == 16 * 64 * TOPK for c in _counts(a).values())  # both replicas, all micro-batches
        for key in ("moe_aux_loss", "moe_z_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-6) and a[key] > 0
    serial, parallel = (_saved_expert_bias(tmp_path / name / "ckpt") for name in runs)
    assert serial.keys() == parallel.keys() and len(serial) == 2
    assert all(torch.equal(serial[n], parallel[n]) and serial[n].abs().sum() > 0 for n in serial)


def _skew_expert_bias(checkpoint, experts: slice, amount: float) -> None:
    """Add ``amount`` to every router's expert bias for ``experts`` in the saved model file."""
    (path,) = glob.glob(_model_file(checkpoint))
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith("router.expert_bias")]:
        tensors[name] = tensors[name].clone()
        tensors[name][experts] += amount
    save_file(tensors, path)


def test_expert_bias_balances_a_skewed_router(tmp_path) -> None:
    """2048 tokens a step (the per-step sampling noise of the counts is a few percent), init std 0.1 so one
    bias step moves few tokens; lr 1e-4 keeps the LM's own pull on the router small."""
    args = [*MOE, "--hidden-size", "16", "--seq-length", "128", "--micro-batch-size", "16",
            "--global-batch-size", "16", "--lr", "1e-4", "--init-method-std", "0.1",
            "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "2e-2"]
    for name in ("start", "skewed"):
        (tmp_path / name).mkdir()
    train_records(tmp_path / "start" / "m.jsonl", [*args, "--train-iters", "1", "--save", str(tmp_path / "ckpt")], 1)
    _skew_expert_bias(tmp_path / "ckpt", slice(0, 2), 1.0)
    records = train_records(tmp_path / "skewed" / "m.jsonl",
                            [*args, "--train-iters", "101", "--load", str(tmp_path / "ckpt")], 1)
    assert [r["iteration"] for r in (records[0], records[-1])] == [2, 101]
    first, last = records[0], records[-1]
    assert first["moe_imbalance"] > 0.8, f"the skew must route most tokens to experts 0 and 1: {_counts(first)}"
    assert last["moe_imbalance"] <= 0.15, [round(r["moe_imbalance"], 3) for r in records[-20:]]
    assert all(sum(c) == 16 * 128 * TOPK for c in _counts(last).values())


def test_log_line_shows_losses_and_the_worst_layer():
    record = {"moe_aux_loss": 1.0025, "moe_z_loss": 4.3125, "moe_imbalance": 0.046875, "moe_imbalance_layer": 1}
    assert format_moe(record) == "moe aux 1.002E+00 z 4.312E+00 imbalance 0.047 (layer 1)"
    assert format_moe({"moe_imbalance": 0.0, "moe_imbalance_layer": 0}) == "moe imbalance 0.000 (layer 0)"
