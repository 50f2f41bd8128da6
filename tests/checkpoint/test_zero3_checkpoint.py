"""ZeRO 3 checkpoints: saved from 1/dp parameter shards, resumed into any stage and layout, converted to HF.

Every run here is the real training pieces (build, optimizer, schedule, ``Trainer``, the
checkpoint's save and load functions) over real gloo worlds, as ``tests/helpers/optimizer_harness.py``.
Two worlds do all the distributed work, in order:

- dp2 (2 ranks): zero 3 (fp32, bf16, fp16) trains 4 iterations straight, and 2 iterations + save
  + 2 resumed (bitwise the same losses, grad norms and weights: same layout, same stage); zero 1 and zero 2
  save their own checkpoints; the zero-3 checkpoint resumes at zero 0 (dp2) and zero 1 (tp2);
- 4 ranks: zero 3 at pp2 x dp2 saves; the checkpoints resume at zero 1/2/3 in tp2 x dp2,
  pp2 x dp2 and dp4 layouts (zero 3 with other prefetch, reshard and unit settings too), and the
  zero-1/zero-2 checkpoints load into zero 3.

Every resumed run - and the serial one this process resumes from both zero-3 checkpoints - must
continue the uninterrupted serial run: losses, grad norms, evaluation losses and final weights
within 1e-5 relative (fp32; the tolerance of tests/optimizer/test_zero_parity.py).
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from megazero.checkpoint import storage
from megazero.checkpoint.convert import read_full_state
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from tests.helpers.compare import rel_err
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import failures
from tests.helpers.reference import full_logits
from tests.helpers.resume import ITERS, SAVED_AT, cfg_for, segment
from tests.helpers.tool_module import load_tool


# same-layout zero-3 resumes that must be bitwise: fp32, and bf16/fp16 (separate fp32 masters, loss scale)
BITWISE = {"z3": {}, "z3.bf16": dict(bf16=True, main_grads_dtype="bf16"),
           "z3.fp16": dict(fp16=True, initial_loss_scale=1024.0)}


def world_dp2(pstate: ParallelState, ck: str) -> dict[str, dict]:
    """Straight and save-then-resume zero-3 runs; zero-1/2 checkpoints; the zero-3 one resumed at zero 0/1."""
    out = {}
    for name, kw in BITWISE.items():
        out[f"{name}.straight"] = segment(pstate, cfg_for(zero=3, **kw))
        segment(pstate, cfg_for(zero=3, iters=SAVED_AT, **kw), save=f"{ck}/{name}_dp2")
        out[f"{name}.resumed"] = segment(pstate, cfg_for(zero=3, **kw), load=f"{ck}/{name}_dp2")
    segment(pstate, cfg_for(zero=1, iters=SAVED_AT), save=f"{ck}/z1_dp2")
    segment(pstate, cfg_for(zero=2, iters=SAVED_AT, mbs=2), save=f"{ck}/z2_dp2")
    out["z0.dp2<-z3_dp2"] = segment(pstate, cfg_for(zero=0), load=f"{ck}/z3_dp2")
    tp2 = ParallelState.build(Layout.from_world(2, 2, 1), "cpu")
    out["z1.tp2<-z3_dp2"] = segment(tp2, cfg_for(zero=1, tp=2), load=f"{ck}/z3_dp2")
    return out


# name: (make_cfg overrides, tp, pp, checkpoint); gbs 8 over dp 4 leaves micro-batches of at most 2
WORLD4_RESUMES = {
    "z3.tp2dp2<-z3_dp2.keep.prefetch2": (dict(zero=3, reshard=False, prefetch=2), 2, 1, "z3_dp2"),
    "z2.pp2dp2<-z3_dp2": (dict(zero=2, mbs=2), 1, 2, "z3_dp2"),
    "z3.dp4<-z3_pp2dp2.unit2": (dict(zero=3, mbs=2, unit_layers=2), 1, 1, "z3_pp2dp2"),
    "z1.tp2dp2<-z3_pp2dp2": (dict(zero=1, mbs=2), 2, 1, "z3_pp2dp2"),
    "z3.tp2dp2<-z1_dp2": (dict(zero=3, mbs=2), 2, 1, "z1_dp2"),
    "z3.pp2dp2<-z2_dp2": (dict(zero=3, mbs=1), 1, 2, "z2_dp2"),
}


def world_4(pstate: ParallelState, ck: str) -> dict[str, dict]:
    """zero 3 at pp2 x dp2 saves; then every resume of WORLD4_RESUMES (each layout's groups built once)."""
    states = {(1, 2): pstate}
    segment(pstate, cfg_for(zero=3, pp=2, mbs=2, iters=SAVED_AT), save=f"{ck}/z3_pp2dp2")
    out = {}
    for name, (kw, tp, pp, source) in WORLD4_RESUMES.items():
        if (tp, pp) not in states:
            states[tp, pp] = ParallelState.build(Layout.from_world(4, tp, pp), "cpu")
        out[name] = segment(states[tp, pp], cfg_for(tp=tp, pp=pp, **kw), load=f"{ck}/{source}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    ck = str(tmp_path_factory.mktemp("zero3_ckpt"))
    serial = ParallelState.serial()
    out: dict[str, Any] = {"ck": ck, "serial": segment(serial, cfg_for(zero=0, mbs=8)),
                           "serial.saved": segment(serial, cfg_for(zero=0, mbs=8, iters=SAVED_AT))}
    out["dp2"] = spawn(world_dp2, 2, ck)
    out["world4"] = spawn(world_4, 4, ck, pp=2)
    for source in ("z3_dp2", "z3_pp2dp2"):
        out[f"serial<-{source}"] = segment(serial, cfg_for(zero=0, mbs=8), load=f"{ck}/{source}")
    return out


def continuation_errors(run: dict, ref: dict, tag: str, start: int = SAVED_AT) -> dict[str, float]:
    """Relative errors of ``run`` against the uninterrupted ``ref`` from iteration ``start`` on: losses,
    grad norms, the last evaluation loss and the final weights."""
    want = ref["records"][start:]
    assert [r["iteration"] for r in run["records"]] == [r["iteration"] for r in want], tag
    assert run["evals"][-1]["iteration"] == ref["evals"][-1]["iteration"] == ITERS, tag
    got_val, want_val = run["evals"][-1]["val_loss"], ref["evals"][-1]["val_loss"]
    errs = {f"{tag}.val_loss": abs(got_val - want_val) / want_val}
    for r, e in zip(run["records"], want):
        errs[f"{tag}.loss[{r['iteration']}]"] = abs(r["loss"] - e["loss"]) / abs(e["loss"])
        errs[f"{tag}.grad_norm[{r['iteration']}]"] = abs(r["grad_norm"] - e["grad_norm"]) / abs(e["grad_norm"])
    for name, value in run["params"].items():
        errs[f"{tag}.{name}"] = rel_err(value, ref["params"][name])
    return errs


def _steps(records: list[dict]) -> list[tuple]:
    return [(r["iteration"], r["loss"], r["grad_norm"], r["loss_scale"]) for r in records]


def test_zero3_resume_in_same_layout_is_bitwise(runs):
    """Same layout, same stage: a resumed zero-3 run repeats the uninterrupted one exactly, on every rank
    (fp32, and bf16/fp16 whose fp32 masters and loss scale come from the checkpoint)."""
    for rank, per_run in enumerate(runs["dp2"]):
        for name in BITWISE:
            straight, resumed = per_run[f"{name}.straight"], per_run[f"{name}.resumed"]
            tag = f"rank {rank} {name}"
            assert _steps(resumed["records"]) == _steps(straight["records"][SAVED_AT:]), tag
            assert resumed["evals"][-1]["val_loss"] == straight["evals"][-1]["val_loss"], tag
            assert all(torch.equal(v, straight["params"][k]) for k, v in resumed["params"].items()), tag


def test_resumes_continue_the_serial_run(runs):
    """zero 3 -> zero 0/1/2/3 and zero 1/2 -> zero 3, across layouts, against one serial run (1e-5)."""
    serial = runs["serial"]
    bad = failures(continuation_errors(runs["dp2"][0]["z3.straight"], serial, "z3.straight", start=0))
    bad.update(failures(continuation_errors(runs["dp2"][0]["z3.resumed"], serial, "z3.resumed")))
    resumed = [(f"rank{rank}.{name}", run) for rank, per_run in enumerate([*runs["dp2"], *runs["world4"]])
               for name, run in per_run.items() if "<-" in name]
    resumed += [(f"serial<-{source}", runs[f"serial<-{source}"]) for source in ("z3_dp2", "z3_pp2dp2")]
    assert len(resumed) == 2 * 2 + 4 * len(WORLD4_RESUMES) + 2
    for tag, run in resumed:
        bad.update(failures(continuation_errors(run, serial, tag)))
    assert not bad, f"{len(bad)} mismatches, e.g. {dict(list(bad.items())[:8])}"


def test_zero3_checkpoint_holds_the_trained_weights_and_converts_to_hf(runs, tmp_path):
    """The pp2 x dp2 zero-3 checkpoint is the serial model at that iteration; its HF conversion gives its logits."""
    transformers = pytest.importorskip("transformers")
    folder = storage.resolve(os.path.join(runs["ck"], "z3_pp2dp2"))
    cfg, state = read_full_state(folder, tp=1)
    want = runs["serial.saved"]["params"]
    assert state.keys() == want.keys()
    assert not failures({name: rel_err(state[name], want[name]) for name in want})
    tool = load_tool("convert_checkpoint")
    assert tool.main(["--input", folder, "--output", str(tmp_path / "hf"), "--to", "hf"]) == 0
    model = GPTModel(cfg.model, TPContext()).eval()
    model.load_state_dict(want)  # the serial run's own weights
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = full_logits(model, ids), hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-4 * ours.abs().max()
