"""Checkpoints through pretrain_gpt.py: exact resume, resharding on load, SIGTERM, conversion to HF.

One uninterrupted 10-iteration run at tp=2 x pp=2 x dp=2 (zero 2) is the reference;
a 5-iteration run saves, and new worlds resume from its checkpoint in the same
layout (bitwise equal losses) and in three others (1e-5 relative).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megazero.parallel.state import free_port
from tests.helpers.launch import ROOT, launch, run_python
from tests.helpers.reference import full_logits

SMALL = ["--arch", "gpt2", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-iters", "10", "--adam-eps", "1e-4", "--bucket-size",
         "20000"]
REFERENCE = ["--tp", "2", "--pp", "2", "--zero", "2"]


def train(tmp, name: str, nproc: int, flags: list[str]) -> list[dict]:
    metrics = os.path.join(tmp, f"{name}.jsonl")
    results = launch("pretrain_gpt.py", [*SMALL, *flags, "--metrics-file", metrics], nproc)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"{name} rank {rank} failed:\n{r.stderr[-3000:]}"
    return [r for r in map(json.loads, open(metrics)) if "event" not in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("resume"))
    straight = train(tmp, "straight", 8, [*REFERENCE, "--train-iters", "10", "--log-timers"])
    first = train(tmp, "first", 8, [*REFERENCE, "--train-iters", "5", "--save", os.path.join(tmp, "ckpt")])
    return tmp, straight, first


def test_log_timers_fields(reference):
    """--log-timers: blocked seconds per axis and the bubble fraction, in every iteration record."""
    _, straight, _ = reference
    for r in straight:
        assert {"tp", "pp", "dp"} <= r["comm_wait_s"].keys() and all(v >= 0 for v in r["comm_wait_s"].values())
        assert 0.0 <= r["bubble_fraction"] < 1.0
        assert r["tflops_per_device"] > 0 and r["comm_bytes"]["reduce_scatter/dp"] > 0


def test_exact_resume_is_bitwise(reference):
    """Also determinism: the 5-iteration run repeats the first 5 losses of the 10-iteration run exactly."""
    tmp, straight, first = reference
    assert [r["loss"] for r in first] == [r["loss"] for r in straight[:5]]
    resumed = train(tmp, "resumed", 8, [*REFERENCE, "--train-iters", "10", "--load", os.path.join(tmp, "ckpt")])
    assert [r["iteration"] for r in resumed] == list(range(6, 11))
    assert [r["consumed_samples"] for r in resumed] == [r["consumed_samples"] for r in straight[5:]]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[5:]]  # bitwise on CPU
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight[5:]]


@pytest.mark.parametrize("nproc,flags", [
    (1, []),
    (8, ["--tp", "4", "--zero", "1"]),
    (8, ["--pp", "4", "--zero", "2"]),
], ids=["tp1pp1dp1", "tp4pp1dp2-zero1", "tp1pp4dp2-zero2"])
def test_resume_into_another_layout(reference, nproc, flags):
    tmp, straight, _ = reference
    name = "reshard-" + "-".join(flags).replace("--", "") if flags else "reshard-serial"
    resumed = train(tmp, name, nproc, [*flags, "--train-iters", "10", "--load", os.path.join(tmp, "ckpt")])
    for got, want in zip(resumed, straight[5:]):
        assert got["iteration"] == want["iteration"]
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want)


def test_converted_checkpoint_matches_megazero_logits(reference, tmp_path):
    """The saved (tp2 pp2) gpt2 model, converted to HF, gives megazero's own logits; it generates text."""
    transformers = pytest.importorskip("transformers")
    from megazero.checkpoint.convert import read_full_state
    from megazero.model.gpt import GPTModel
    from megazero.model.transformer import TPContext

    tmp, _, _ = reference
    out = run_python(["tools/convert_checkpoint.py", "--input", os.path.join(tmp, "ckpt"), "--output",
                      str(tmp_path / "hf"), "--to", "hf"])
    assert out.returncode == 0, out.stderr
    cfg, state = read_full_state(os.path.join(tmp, "ckpt"), tp=1)
    model = GPTModel(cfg.model, TPContext()).eval()
    model.load_state_dict(state)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([tok.encode("Return the number of items in a container.")])
    ours = full_logits(model, ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4 * ours.abs().max()
    text = tok.decode(hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)[0])
    assert text.startswith("Return the number of items in a container.")


def test_sigterm_saves_the_current_iteration(tmp_path):
    port, procs = str(free_port()), []
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR":
               "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *SMALL, "--tp", "2",
                                       "--train-iters", "100000", "--save", str(ckpt), "--metrics-file", str(metrics)],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count('"loss"') < 3):
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], [p.stderr.read().decode()[-2000:] for p in procs]
    last = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r][-1]["iteration"]
    assert (ckpt / "latest").read_text().strip() == f"iter_{last:07d}"
    resumed = launch("pretrain_gpt.py", [*SMALL, "--train-iters", str(last + 1), "--load", str(ckpt)], 1)
    assert resumed[0].returncode == 0, resumed[0].stderr[-2000:]
