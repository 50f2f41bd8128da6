"""pretrain_gpt.py --zero 3 end to end: tp2 x pp2 x dp2 (8 ranks) on the built-in corpus, resumed bitwise.

The `make train` preset (configs/tiny.yaml) for 6 iterations, evaluating and saving every 3;
a second world resumes from the iteration-3 checkpoint and must log exactly the losses, grad
norms, learning rates, sample counts and evaluation loss of the uninterrupted run (same layout,
same stage, deterministic CPU kernels: bitwise). About a minute on 2 cores.
"""
from __future__ import annotations

import json
import math
import os

from tests.helpers.launch import metrics_records

FLAGS = ["--config", "configs/tiny.yaml", "--tp", "2", "--pp", "2", "--zero", "3", "--train-iters", "6",
         "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1"]
RESUMED_FROM = 3


def _run(tmp_path, name: str, extra: list[str]) -> list[dict]:
    return metrics_records(tmp_path / f"{name}.jsonl", [*FLAGS, *extra], 8, timeout=600)


def _steps(records: list[dict]) -> list[tuple]:
    """What must repeat bitwise: (iteration, loss, grad norm, lr, consumed samples) per iteration."""
    return [(r["iteration"], r["loss"], r["grad_norm"], r["lr"], r["consumed_samples"])
            for r in records if "event" not in r]


def _evals(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["val_loss"] for r in records if r.get("event") == "eval"}


def test_zero3_tp2_pp2_dp2_trains_and_resumes_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    straight = _run(tmp_path, "straight", ["--save", str(ckpt), "--save-interval", str(RESUMED_FROM)])
    steps = _steps(straight)
    assert [s[0] for s in steps] == list(range(1, 7))
    assert steps[-1][1] < steps[0][1], f"loss should fall: {[s[1] for s in steps]}"
    evals = _evals(straight)  # evaluation under zero 3 (units gathered and freed without backward)
    assert list(evals) == [3, 6] and all(math.isfinite(v) for v in evals.values()) and evals[6] < evals[3]
    memory = [r for r in straight if r.get("event") == "memory"]
    assert len(memory) == 8 and all(m["layout"]["zero"] == 3 for m in memory)
    assert all(m["params_bytes"] * 2 == m["local_parameters"] * 4 for m in memory)  # fp32 params, 1/dp each
    assert all(r["comm_bytes"]["all_gather.forward/dp"] > 0 for r in straight if "event" not in r)

    saved = ckpt / f"iter_{RESUMED_FROM:07d}"
    meta = json.loads((saved / "metadata.json").read_text())
    assert meta["layout"]["zero"] == 3 and len(meta["optimizer"]["files"]) == 8  # one shard per (tp, pp, dp)
    assert sorted(os.listdir(ckpt)) == ["config.yaml", "iter_0000003", "iter_0000006", "latest"]

    resumed = _run(tmp_path, "resumed", ["--load", str(saved)])
    assert _steps(resumed) == steps[RESUMED_FROM:]  # bitwise on CPU
    assert _evals(resumed) == {6: evals[6]}
