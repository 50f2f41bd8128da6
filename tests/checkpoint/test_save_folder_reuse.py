"""A --save folder a user reuses: a run that does not continue the checkpoint already there says so.

Without --load (or loading another folder), a run starts anew, its saves go beside the older run's and
``latest`` moves to them; one line on start-up says that, and how to continue the older run instead.
"""
from __future__ import annotations

from tests.helpers.launch import launch

TINY = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1"]
NOTICE = "already holds iter_0000002, which this run does not continue (no --load)"


def _run(*flags: str) -> str:
    (result,) = launch("pretrain_gpt.py", [*TINY, *flags], 1)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_a_run_into_a_folder_holding_another_runs_checkpoint_says_so(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = _run("--train-iters", "2", "--save", ckpt)
    assert "already holds" not in first
    again = _run("--train-iters", "2", "--save", ckpt, "--keep-last", "1")
    assert NOTICE in again and "--keep-last 1 counts those too" in again and f"pass --load {ckpt}" in again
    resumed = _run("--train-iters", "3", "--save", ckpt, "--load", ckpt)
    assert "already holds" not in resumed
