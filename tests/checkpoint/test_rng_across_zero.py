"""Dropout streams resume across ZeRO stages: the RNG files depend on the ranks' layout, not on the stage.

With dropout on, a dp2 run at ZeRO 1 saves at iteration 2 of 4; the checkpoint resumed at
ZeRO 3 in the same tp/pp/dp layout continues the uninterrupted ZeRO-1 run's losses (to the
1e-5 relative parity tolerance of ZeRO 3 vs ZeRO 1). Reseeded streams would draw other
dropout masks and miss it by far more.
"""
from __future__ import annotations

import json
import os

from tests.helpers.launch import launch

FLAGS = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--lr", "1e-3", "--hidden-dropout", "0.3", "--attention-dropout", "0.3", "--train-iters", "4"]


def _losses(tmp, name: str, flags: list[str]) -> dict[int, float]:
    metrics = os.path.join(tmp, f"{name}.jsonl")
    results = launch("pretrain_gpt.py", [*FLAGS, *flags, "--metrics-file", metrics], 2)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"{name} rank {rank}:\n{r.stderr[-3000:]}"
    return {r["iteration"]: r["loss"] for r in map(json.loads, open(metrics)) if "loss" in r}


def test_zero1_checkpoint_resumes_dropout_streams_at_zero3(tmp_path):
    tmp, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    straight = _losses(tmp, "zero1", ["--zero", "1", "--save", ckpt, "--save-interval", "2"])
    resumed = _losses(tmp, "zero3", ["--zero", "3", "--load", os.path.join(ckpt, "iter_0000002")])
    assert sorted(resumed) == [3, 4]
    for it, loss in resumed.items():
        assert abs(loss - straight[it]) <= 1e-5 * abs(straight[it]), (it, loss, straight[it])
