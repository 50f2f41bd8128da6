"""Resuming an MoE checkpoint takes its model without repeating the model flags (issue 33).

- ``--load CKPT --ep 2`` (no --num-experts) parses; the expert-grid flags are checked once the checkpoint's
  model is merged, and still refused in one line when nothing supplies experts.
- The MoE training settings (balancing and z-loss, bias step, capacity, debug router) come from the
  checkpoint by default and an explicit flag overrides them, said in one line; a routing setting that the
  weights assume still contradicts.
- End to end: a 2-rank ep 2 checkpoint resumes at ``--ep 2`` with ``--moe-aux-loss-coeff 0.01`` over its 0
  (which then trains with the aux loss) and continues at ``--ep 1``, neither repeating --num-experts.
"""
from __future__ import annotations

import json

import pytest

from megazero.arguments import parse_config
from megazero.checkpoint.load import merge_config
from megazero.checkpoint.overridable import overrides_line
from megazero.config import ConfigError
from megazero.training.run import validate
from tests.helpers.launch import launch, train_records

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
TINY = ["--arch", "gpt2", "--num-layers", "2", "--num-attention-heads", "2", "--hidden-size", "32",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--eval-interval", "0", "--log-interval", "1", "--moe-ffn-hidden-size", "32"]


def _saved(argv: list[str]) -> dict:
    return {"config": parse_config(argv)[0].to_flat()}


def test_expert_grid_flags_wait_for_the_checkpoints_model(tmp_path):
    cfg = parse_config(["--load", str(tmp_path), "--ep", "2"])[0]  # before: "--ep 2 only applies with ..."
    merged = merge_config(_saved(MOE), cfg)[0]
    assert (merged.model.num_experts, merged.parallel.ep) == (4, 2)
    validate(merged, 2)
    with pytest.raises(ConfigError, match=r"^--expert-model-parallel-size 2 only applies with --num-experts E "
                                          r"\(here no --num-experts\); drop it or pass --num-experts E\.$"):
        validate(cfg, 2)  # no checkpoint supplied a model (the restart idiom's first start)
    with pytest.raises(ConfigError, match=r"^--expert-model-parallel-size 2 only applies with --num-experts E"):
        merge_config(_saved([]), cfg)  # a dense checkpoint
    with pytest.raises(ConfigError, match=r"^--expert-model-parallel-size 2 only applies with --num-experts E"):
        parse_config(["--ep", "2"])  # without --load: refused where it is parsed, as before


def test_moe_training_settings_are_the_checkpoints_unless_given(tmp_path):
    saved = _saved(MOE)  # a converted checkpoint: coefficient 0
    given = parse_config(["--load", str(tmp_path), "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
                          "--moe-expert-capacity-factor", "1.5"])[0]
    merged, taken = merge_config(saved, given)  # before: "--moe-aux-loss-coeff 0.01 contradicts the checkpoint's 0.0"
    assert (merged.model.moe_aux_loss_coeff, merged.model.moe_z_loss_coeff) == (0.01, 0.001)
    assert merged.model.moe_expert_capacity_factor == 1.5 and not [t for t in taken if "coeff" in t]
    assert overrides_line(saved, merged) == (
        "megazero: training settings given over the checkpoint's: --moe-aux-loss-coeff 0.01 (the checkpoint's 0.0), "
        "--moe-z-loss-coeff 0.001 (the checkpoint's 0.0), --moe-expert-capacity-factor 1.5 (the checkpoint's None); "
        "the weights are the same")
    kept = merge_config(_saved([*MOE, "--moe-aux-loss-coeff", "0.02"]), parse_config(["--load", str(tmp_path)])[0])[0]
    assert kept.model.moe_aux_loss_coeff == 0.02 and overrides_line(saved, kept) is None
    with pytest.raises(ConfigError, match=r"^--moe-router-topk 1 contradicts the checkpoint's 2; "):
        merge_config(saved, parse_config(["--load", str(tmp_path), "--moe-router-topk", "1"])[0])


def test_resume_takes_the_checkpoints_moe_model_at_any_ep(tmp_path):
    """Saved at ep 2; planned (--dry-run) and resumed at ep 2 with --moe-aux-loss-coeff 0.01 and at ep 1 with no
    flag (none repeats --num-experts): the same first loss (same weights and batch; the LM loss alone is logged), and
    only the first logs and adds the aux loss, whose gradient changes every step's grad norm."""
    ckpt = str(tmp_path / "ckpt")
    train_records(tmp_path / "save.jsonl", [*TINY, *MOE, "--train-iters", "2", "--ep", "2", "--save", ckpt], 2)
    resume = [*TINY, "--train-iters", "4", "--load", ckpt]  # no --num-experts, no --moe-* model flags
    planned = launch("pretrain_gpt.py", [*resume, "--ep", "2", "--dp", "2", "--dry-run"], 1)[0]  # the ckpt's model
    assert planned.returncode == 0 and "experts" in planned.stdout, planned.stderr[-2000:]
    metrics = tmp_path / "aux.jsonl"
    aux = launch("pretrain_gpt.py", [*resume, "--ep", "2", "--moe-aux-loss-coeff", "0.01", "--metrics-file",
                                     str(metrics)], 2)
    assert [r.returncode for r in aux] == [0, 0], aux[0].stderr[-2000:]
    assert "--moe-aux-loss-coeff 0.01 (the checkpoint's 0.0)" in aux[0].stdout
    with_aux = [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r]
    plain = train_records(tmp_path / "ep1.jsonl", [*resume, "--ep", "1"], 1)
    assert [r["iteration"] for r in with_aux] == [r["iteration"] for r in plain] == [3, 4]
    assert with_aux[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-5)
    assert all(r["moe_aux_loss"] > 0 for r in with_aux) and all(r.get("moe_aux_loss", 0) == 0 for r in plain)
    for ep1, balanced in zip(plain, with_aux, strict=True):
        assert balanced["grad_norm"] != pytest.approx(ep1["grad_norm"], rel=1e-5)
