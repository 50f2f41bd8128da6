"""``--optimizer muon`` through pretrain_gpt.py: bad input refused in one line before any process group, the
layouts Muon is built for (optimizer offload included) accepted, and checkpoints across AdamW and Muon.

The refusals are checked in-process (every one of them runs before the process groups: ``prepare_run``); the
checkpoint cases launch real ranks: AdamW saves, Muon at dp 2 (ZeRO 1) resumes it with ``--no-load-optim`` and
saves every iteration, and a Muon resume from its own iteration-3 checkpoint gives iteration 4's loss and grad
norm bitwise; loading either optimizer's state into the other is refused naming ``--no-load-optim``.
"""
from __future__ import annotations

import os

import pytest

from tests.helpers.launch import train_records
from tests.helpers.refusals import refusal_line

SMALL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
         "--lr", "1e-3", "--lr-decay-style", "constant", "--adam-eps", "1e-4", "--train-iters", "2"]
MUON = ["--optimizer", "muon"]

BAD_INPUT = [  # (ranks, flags, the start of the one line after "pretrain_gpt.py: error: ")
    (1, ["--muon-momentum", "0.9"], "--muon-momentum 0.9 only applies with --optimizer muon (here --optimizer "
                                    "adamw); drop it or pass --optimizer muon."),
    (1, ["--no-muon-nesterov"], "--no-muon-nesterov only applies with --optimizer muon"),
    (1, ["--muon-ns-steps", "3"], "--muon-ns-steps 3 only applies with --optimizer muon"),
    (1, ["--muon-lr-adjust", "match_rms_adamw"], "--muon-lr-adjust match_rms_adamw only applies with --optimizer muon"),
    (1, ["--muon-adam-lr", "1e-3"], "--muon-adam-lr 0.001 only applies with --optimizer muon"),
    (1, [*MUON, "--muon-momentum", "1"], "--muon-momentum must be in [0, 1), got 1.0"),
    (1, [*MUON, "--muon-momentum=-0.1"], "--muon-momentum must be in [0, 1), got -0.1"),
    (1, [*MUON, "--muon-ns-steps", "0"], "--muon-ns-steps must be in [1, 99], got 0"),
    (1, [*MUON, "--muon-adam-lr=-1e-3"], "--muon-adam-lr must be >= 0, got -0.001"),
    (1, [*MUON, "--muon-adam-lr", "1e-3", "--lr", "0", "--min-lr", "0"], "--muon-adam-lr follows the --lr schedule"),
    (1, [*MUON, "--muon-lr-adjust", "spectral"], "argument --muon-lr-adjust: invalid choice: 'spectral'"),
    (1, ["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'"),
]


def _refusal_line(nproc: int, flags: list[str]) -> str:
    return refusal_line([*SMALL, *flags], nproc)


@pytest.mark.parametrize("nproc,flags,start", BAD_INPUT, ids=[" ".join(b[1]) for b in BAD_INPUT])
def test_bad_muon_input_is_refused_in_one_line(nproc, flags, start):
    line = _refusal_line(nproc, flags)
    assert "\n" not in line.strip(), line
    assert line.startswith("pretrain_gpt.py: error: " + start), line


def test_the_layouts_muon_is_built_for_pass_the_checks():
    from megazero.arguments import parse_config
    from megazero.run_plan import RunPlan

    for nproc, flags in ((2, ["--zero", "2"]), (2, ["--tp", "2", "--sequence-parallel", "--zero", "1"]),
                         (4, ["--tp", "2", "--zero", "0", "--bf16"]), (2, ["--zero", "1", "--fp16"]),
                         (2, ["--pp", "2"]), (2, ["--cp", "2"]), (1, ["--num-experts", "2"]),
                         (4, ["--num-experts", "2", "--ep", "2", "--pp", "2", "--zero", "1"]),
                         (2, ["--zero", "1", "--offload-optimizer", "cpu"]),
                         (2, ["--zero", "2", "--offload-optimizer", "disk", "--offload-path", "off"])):
        cfg = parse_config([*SMALL, *MUON, *flags])[0]
        cfg.refuse_inapplicable()
        RunPlan.resolve(cfg, nproc)


def _train(tmp, name: str, nproc: int, flags: list[str]) -> list[dict]:
    return train_records(os.path.join(tmp, f"{name}.jsonl"), [*SMALL, *flags], nproc)


def test_checkpoints_across_adamw_and_muon(tmp_path):
    adamw, muon = str(tmp_path / "adamw"), str(tmp_path / "muon")
    _train(tmp_path, "adamw", 1, ["--save", adamw])
    line = _refusal_line(2, [*MUON, "--zero", "1", "--load", adamw, "--train-iters", "4"])
    assert line == (f"pretrain_gpt.py: error: --optimizer muon cannot load the adamw optimizer state of --load "
                    f"{adamw}; pass --no-load-optim to start muon's state fresh from the loaded weights, or "
                    f"--optimizer adamw."), line
    import pretrain_gpt
    from megazero.training.run import prepare_run

    cfg, _ = pretrain_gpt._parse([*SMALL, *MUON, "--load", adamw, "--finetune", "--train-iters", "4"])
    assert prepare_run(cfg, 1, None, lambda _: None) is not None  # --finetune reads no optimizer state
    resumed = _train(tmp_path, "muon", 2, [*MUON, "--zero", "1", "--load", adamw, "--no-load-optim",
                                           "--train-iters", "4", "--save", muon, "--save-interval", "1"])
    assert [r["iteration"] for r in resumed] == [3, 4]
    line = _refusal_line(2, ["--zero", "1", "--load", muon, "--train-iters", "6"])
    assert line.startswith("pretrain_gpt.py: error: --optimizer adamw cannot load the muon optimizer state of "
                           "--load") and "--no-load-optim" in line, line
    again = _train(tmp_path, "again", 2, [*MUON, "--zero", "1", "--load", os.path.join(muon, "iter_0000003"),
                                          "--train-iters", "4"])
    assert [(r["iteration"], r["loss"], r["grad_norm"]) for r in again] == \
        [(r["iteration"], r["loss"], r["grad_norm"]) for r in resumed[1:]]

