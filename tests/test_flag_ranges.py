"""Every numeric flag is range-checked where it is parsed, and a flag that cannot apply to the run is refused:
one line naming the flag, never a silent run.

Each case below was accepted before (issue 22): ``--eval-iters 0`` reported a validation loss of 0,
``--eval-interval -1`` evaluated every step, ``--lr-decay-iters -3`` trained at LR 0, a warm-up
longer than the decay jumped to the minimum LR, ``--make-vocab-size-divisible-by 0`` crashed with a
traceback, and ``--dp`` outside ``--dry-run`` was ignored. Issue 30: ``--compile-backend`` without
``--compile``, ``--zero3-*`` below ZeRO 3, ``--overlap-param-gather`` at ZeRO 3, ``--offload-buffer-size``
without disk offload and ``--cp-comm-type`` at cp 1 were accepted and ignored. The metrics file must stay
strict JSON.
"""
from __future__ import annotations

import io
import json
import math
import subprocess

import pytest

from megazero.arguments import parse_config
from megazero.config import Config, ConfigError
from megazero.optimizer.lr import LRSchedule
from megazero.training.metrics import MetricsLog
from tests.helpers.launch import ROOT, run_python

BAD = [  # (flags, the flag the one line must name)
    (["--eval-iters", "0", "--eval-interval", "5"], "--eval-iters"),
    (["--eval-interval", "-1"], "--eval-interval"),
    (["--eval-iters", "-2"], "--eval-iters"),
    (["--lr-decay-iters", "-3"], "--lr-decay-iters"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters"),
    (["--lr-warmup-iters", "50", "--lr-decay-iters", "40"], "--lr-decay-iters"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction"),
    (["--lr-warmup-fraction", "-0.1"], "--lr-warmup-fraction"),
    (["--adam-beta1", "1.0"], "--adam-beta1"),
    (["--adam-beta2", "-0.5"], "--adam-beta2"),
    (["--adam-eps", "0"], "--adam-eps"),
    (["--adam-eps=-1e-8"], "--adam-eps"),
    (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr-wsd-decay-fraction", "2"], "--lr-wsd-decay-fraction"),
    (["--norm-epsilon", "0"], "--norm-epsilon"),
    (["--init-method-std", "-1"], "--init-method-std"),
    (["--num-query-groups", "0"], "--num-query-groups"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size"),
    (["--vocab-size", "0"], "--vocab-size"),
    (["--seed", "-1"], "--seed"),
    (["--save-interval", "-1"], "--save-interval"),
    (["--keep-last", "0"], "--keep-last"),
    (["--bucket-size", "0"], "--bucket-size"),
    (["--tp", "0"], "--tp"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes"),
    (["--min-loss-scale", "0"], "--min-loss-scale"),
]


IGNORED = [  # (flags, the one line's start): each was accepted and did nothing before issue 30 (some: issue 22)
    (["--compile-backend", "aot_eager"],
     "--compile-backend aot_eager only applies with --compile (here no --compile)"),
    (["--zero", "2", "--zero3-prefetch", "2"], "--zero3-prefetch 2 only applies with --zero 3 (here --zero 2); "
                                               "drop it or pass --zero 3."),
    (["--zero", "1", "--zero3-unit-layers", "2"], "--zero3-unit-layers 2 only applies with --zero 3 (here --zero 1)"),
    (["--zero", "2", "--no-reshard-after-forward"], "--no-reshard-after-forward only applies with --zero 3"),
    (["--zero", "3", "--overlap-param-gather"],
     "--overlap-param-gather only applies with --zero 1 or 2 (here --zero 3)"),
    (["--overlap-param-gather"], "--overlap-param-gather only applies with --zero 1 or 2 (here --zero 0)"),
    (["--zero", "1", "--reduce-every-micro-batch"], "--reduce-every-micro-batch only applies with --zero 2"),
    (["--offload-buffer-size", "4096"], "--offload-buffer-size 4096 only applies with --offload-optimizer disk"),
    (["--zero", "1", "--offload-optimizer", "cpu", "--offload-buffers", "3"],
     "--offload-buffers 3 only applies with --offload-optimizer disk (here --offload-optimizer cpu)"),
    (["--offload-path", "off"], "--offload-path off only applies with --offload-optimizer or --offload-params disk"),
    (["--cp-comm-type", "a2a"], "--cp-comm-type a2a only applies with --cp 2 or more (here --cp 1)"),
    (["--cp", "2", "--cp-a2a-size", "2"], "--cp-a2a-size 2 only applies with --cp-comm-type a2a+p2p"),
    (["--pipeline-schedule", "gpipe"], "--pipeline-schedule gpipe only applies with --pp 2 or more (here --pp 1)"),
    (["--recompute", "selective", "--recompute-num-layers", "2"],
     "--recompute-num-layers 2 only applies with --recompute full or auto (here --recompute selective)"),
    (["--memory-budget-gb", "8"], "--memory-budget-gb 8.0 only applies with --recompute auto (here --recompute none)"),
    (["--initial-loss-scale", "1024"], "--initial-loss-scale 1024.0 only applies with --fp16"),
    (["--bf16", "--loss-scale-window", "10"], "--loss-scale-window 10 only applies with --fp16"),
    (["--lr-wsd-decay-fraction", "0.3"], "--lr-wsd-decay-fraction 0.3 only applies with --lr-decay-style wsd"),
    (["--save-interval", "10"], "--save-interval 10 only applies with --save DIR (here no --save)"),
    (["--keep-last", "2", "--async-save"], "--keep-last 2 only applies with --save DIR"),
    (["--load", "ckpt", "--async-save"], "--async-save only applies with --save DIR"),
    (["--wandb-mode", "offline"], "--wandb-mode offline only applies with --wandb-project P (here no --wandb-project)"),
    (["--wandb-dir", "w"], "--wandb-dir w only applies with --wandb-project P"),
]


@pytest.mark.parametrize("flags,name", BAD + IGNORED, ids=[" ".join(f) for f, _ in BAD + IGNORED])
def test_out_of_range_flag_is_one_line_naming_it(flags, name):
    with pytest.raises(ConfigError) as err:
        parse_config(flags)
    text = str(err.value)
    assert name in text and "\n" not in text, text


@pytest.mark.parametrize("flags", [
    ["--compile", "--compile-backend", "aot_eager"], ["--zero", "3", "--zero3-prefetch", "2", "--zero3-unit-layers",
                                                      "2", "--no-reshard-after-forward"],
    ["--zero", "2", "--overlap-param-gather", "--reduce-every-micro-batch"], ["--cp", "2", "--cp-comm-type", "a2a"],
    ["--cp", "4", "--cp-comm-type", "a2a+p2p", "--cp-a2a-size", "2"],
    ["--zero", "1", "--offload-optimizer", "disk", "--offload-path", "off", "--offload-buffers", "3",
     "--offload-buffer-size", "4096"],
    ["--recompute", "auto", "--memory-budget-gb", "8", "--recompute-num-layers", "1"],
    ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "10"],
    ["--lr-decay-style", "wsd", "--lr-wsd-decay-fraction", "0.3"],
    ["--sequence-parallel"],  # at tp 1 too: the presets set it for any --tp
    ["--wandb-project", "p", "--wandb-name", "n", "--wandb-mode", "offline", "--wandb-dir", "w"],
])
def test_flags_that_apply_are_accepted(flags):
    parse_config(flags)


def test_only_given_settings_are_refused():
    """A default never trips the check; a Python caller's off-default value counts as given; ``updated``
    (a planner trying --zero 1 for a --zero 3 run) derives configs without refusing the user's settings."""
    parse_config(["--zero", "1"])  # --zero3-prefetch's default 1 is not the user's
    with pytest.raises(ConfigError, match="--zero3-prefetch 2 only applies with --zero 3"):
        Config.from_flat({"zero3_prefetch": 2})
    with pytest.raises(ConfigError, match="--zero3-prefetch 1 only applies with --zero 3"):
        Config.from_flat({"zero3_prefetch": 1}, explicit=frozenset({"zero3_prefetch"}))  # named, though default
    cfg, _ = parse_config(["--zero", "3", "--zero3-prefetch", "2"])
    assert cfg.updated(zero=1).parallel.zero3_prefetch == 2


@pytest.mark.parametrize("flags", [["--eval-iters", "0"], ["--lr-warmup-fraction", "1"], ["--adam-beta1", "0"],
                                   ["--weight-decay", "0"], ["--lr-warmup-iters", "500", "--train-iters", "20"],
                                   ["--lr-warmup-iters", "50", "--lr-decay-iters", "40", "--lr-decay-style",
                                    "constant"], ["--save", "ckpt", "--save-interval", "5", "--keep-last", "1",
                                                  "--async-save"]])
def test_edge_values_that_work_are_accepted(flags):
    """The edges stay open: no evaluation, a whole-run warm-up (a short test run of a preset), beta 0."""
    parse_config(flags)


def test_schedule_never_jumps_from_peak_to_min():
    """Whatever the flags accept, the LR after warm-up starts at the peak and only decays from there."""
    for warmup, decay in ((10, 11), (39, 40), (0, 5)):
        cfg, _ = parse_config(["--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-iters", str(warmup),
                               "--lr-decay-iters", str(decay), "--train-iters", "60"])
        lr = LRSchedule(cfg.optimizer, cfg.training.train_iters)
        values = [lr(i) for i in range(1, 61)]
        peak = values.index(max(values))
        assert all(b <= a + 1e-12 for a, b in zip(values[peak:], values[peak + 1:])), values
        assert all(abs(b - a) < 0.95 for a, b in zip(values, values[1:])), (warmup, decay, values)


def _pretrain(*flags: str) -> subprocess.CompletedProcess:
    return run_python(["pretrain_gpt.py", *flags], timeout=120, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("flags,words", [(["--dp", "4"], "--dp 4 only applies with --dry-run"),
                                         (["--dp", "0", "--dry-run"], "--dp must be >= 1"),
                                         (["--eval-interval", "-1"], "--eval-interval must be >= 0"),
                                         (["--zero3-prefetch", "2"], "--zero3-prefetch 2 only applies with --zero 3")])
def test_pretrain_refuses_in_one_line(flags, words):
    """Through the script as a user runs it: exit 2, one stderr line, no traceback, before any group."""
    r = _pretrain("--config", "configs/tiny.yaml", *flags)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and words in lines[0], r.stderr


def test_metrics_file_is_strict_json_for_non_finite_values(tmp_path):
    """A skipped step's NaN grad norm is written as null with the reason beside it (RFC 8259 has no NaN)."""
    path = tmp_path / "m.jsonl"
    log = MetricsLog(str(path), enabled=True, stream=io.StringIO())
    log.record({"iteration": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3,
                "comm_wait_s": {"dp": float("-inf")}})
    log.close()

    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    row = json.loads(path.read_text(), parse_constant=refuse)
    assert row["loss"] is None and row["loss_nonfinite"] == "nan"
    assert row["grad_norm"] is None and row["grad_norm_nonfinite"] == "inf"
    assert row["comm_wait_s"] == {"dp": None, "dp_nonfinite": "-inf"}
    assert row["lr"] == 1e-3 and math.isfinite(row["lr"])
