"""MoE checkpoints are layout-free: expert tensors stored whole by global expert id, like every other tensor.

The tiny MoE model (tests/helpers/moe_ckpt.py: gpt2 experts with biases, a shared expert, a dense layer 0 so a
pp 2 run has a stage without experts, the router's expert bias) is trained 2 iterations in this process and
saved; loaded and saved again with each router's expert bias set to seeded values, it is the origin ``serial``.
A 4-rank world then walks CHAIN: each layout loads the previous layout's checkpoint and saves its own at once.
That is 14 save/load pairs across (tp, etp, ep, pp, cp, zero): ep 1 -> 2 -> 4 -> 1, etp 1 <-> 2 (with etp = tp,
etp < tp and etp > tp), ZeRO 0, 1, 2, 3 (1 <-> 3 both ways), tp 1/2/4 with sequence parallelism, pp 1/2, cp 2,
the optimizer state on disk and --async-save; the last checkpoint is loaded and saved once more in this process
(a 15th pair, back to one rank). Every checkpoint must
hold exactly the origin's tensors, read back whole without megazero's loader: model weights, the expert bias,
fp32 master weights and both Adam moments (bitwise; a region no file covers stays NaN and fails).

A round trip alone would pass if save and load placed experts wrongly in the same way, so the same world also
trains 2 iterations from scratch at tp2 x etp2 x ep2, ZeRO 3, and its checkpoint must match the one trained in
this process within 1e-5 (what training parity allows). At that layout, and in this process, a run resumed from
its own checkpoint repeats the uninterrupted 4-iteration run bitwise (losses, grad norms, evaluation, weights).

Refused in one line: a dense checkpoint into an MoE model, a checkpoint with another number of experts, and an
index whose expert regions leave experts uncovered.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any

import pytest
import torch

from megazero.checkpoint import load as ckpt_load
from megazero.checkpoint import storage
from megazero.config import ConfigError
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.training.parallelize import build_model_chunks
from tests.helpers import serial_ckpt
from tests.helpers.compare import rel_err
from tests.helpers.dist import spawn
from tests.helpers.moe_ckpt import full_contents, layout_state, moe_cfg, random_biases, round_trip
from tests.helpers.resume import SAVED_AT, segment

# name: layout (tp, etp (None: = tp), ep, pp, cp, zero) over 4 ranks; each loads the previous one's checkpoint.
# "disk": the optimizer state offloaded to disk (its views are reused bucket by bucket); "async": --async-save
CHAIN: dict[str, dict[str, Any]] = {
    "ep2.z1": dict(ep=2, zero=1),
    "ep4.z3": dict(ep=4, zero=3),
    "ep1.z1": dict(ep=1, zero=1),
    "cp2.ep2.z1": dict(cp=2, ep=2, zero=1),  # ep borrows the cp ranks: dp x cp rank != expert-DP rank
    "ep2.z3.disk.async": dict(ep=2, zero=3, disk=True, asynchronous=True),
    "tp2.etp2.ep2.z3": dict(tp=2, ep=2, zero=3),
    "tp2.etp1.ep2.z1": dict(tp=2, etp=1, ep=2, zero=1),
    "pp2.ep2.z0": dict(pp=2, ep=2, zero=0),
    "tp2.pp2.etp2.z2": dict(tp=2, pp=2, zero=2),
    "pp2.ep2.z3": dict(pp=2, ep=2, zero=3),
    "tp4.etp1.ep4.z1": dict(tp=4, etp=1, ep=4, zero=1),
    "etp2.ep2.z2": dict(etp=2, ep=2, zero=2),
    "tp2.etp1.ep1.z0": dict(tp=2, etp=1, zero=0),
    "ep4.z3.last": dict(ep=4, zero=3),
}
TRAINED = dict(tp=2, ep=2, zero=3)  # etp = tp = 2


def world(pstate: ParallelState, ck: str) -> dict[str, Any]:
    """The CHAIN of round trips, then the TRAINED layout: straight, and saved at 2 then resumed."""
    source = f"{ck}/serial"
    for name, layout in CHAIN.items():
        layout = dict(layout)
        asynchronous, disk = layout.pop("asynchronous", False), layout.pop("disk", False)
        cfg = moe_cfg(**layout, offload_path=f"{ck}/offload.{name}" if disk else None)
        round_trip(layout_state(4, cfg), cfg, source, f"{ck}/{name}", asynchronous=asynchronous)
        source = f"{ck}/{name}"
    state = layout_state(4, moe_cfg(**TRAINED))
    straight = segment(state, moe_cfg(**TRAINED))
    segment(state, moe_cfg(**TRAINED, iters=SAVED_AT), save=f"{ck}/world.trained")
    return {"straight": straight, "resumed": segment(state, moe_cfg(**TRAINED), load=f"{ck}/world.trained")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    ck = str(tmp_path_factory.mktemp("moe_ckpt"))
    serial, cfg = ParallelState.serial(), moe_cfg(mbs=8)
    out: dict[str, Any] = {"ck": ck, "straight": segment(serial, cfg)}
    segment(serial, moe_cfg(mbs=8, iters=SAVED_AT), save=f"{ck}/serial.trained")
    out["resumed"] = segment(serial, cfg, load=f"{ck}/serial.trained")
    round_trip(serial, cfg, f"{ck}/serial.trained", f"{ck}/serial", edit=random_biases)
    out["world"] = spawn(world, 4, ck)
    round_trip(serial, cfg, f"{ck}/{list(CHAIN)[-1]}", f"{ck}/serial.end")
    return out


def _tensors(contents: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in contents.items() if isinstance(v, torch.Tensor)}


def test_round_trips_across_layouts_are_bitwise(runs):
    """Each checkpoint of the chain holds the origin's weights, expert bias and optimizer state, bit for bit."""
    origin = full_contents(f"{runs['ck']}/serial")
    tensors = _tensors(origin)
    assert not any(t.isnan().any() for t in tensors.values())
    assert any(".experts." in k for k in tensors) and any(k.startswith("optim/") for k in tensors)
    bias = tensors["model/layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and torch.equal(
        bias, torch.randn(4, generator=torch.Generator().manual_seed(1001)))  # the seeded values, not zeros
    assert all(t.abs().sum() > 0 for k, t in tensors.items() if k.endswith("/exp_avg_sq"))  # trained moments
    for name in [*CHAIN, "serial.end"]:
        got = full_contents(f"{runs['ck']}/{name}")
        assert got["scalars"] == origin["scalars"], name
        want = {**dict(tp=1, etp=None, ep=1, pp=1, cp=1, zero=0), **CHAIN.get(name, {})}
        want["etp"] = want["etp"] or want["tp"]
        assert {k: got["layout"][k] for k in ("tp", "etp", "ep", "pp", "cp", "zero")} == \
            {k: want[k] for k in ("tp", "etp", "ep", "pp", "cp", "zero")}, name
        got_tensors = _tensors(got)
        assert got_tensors.keys() == tensors.keys(), name
        for key, t in tensors.items():
            assert torch.equal(got_tensors[key], t), f"{name}: {key}"


def test_experts_are_saved_by_global_id(runs):
    """Trained from scratch at tp2 x etp2 x ep2 (ZeRO 3), the checkpoint matches the one trained in one process:
    every expert (and its optimizer state) is where the serial model has it."""
    serial = _tensors(full_contents(f"{runs['ck']}/serial.trained"))
    world_ckpt = full_contents(f"{runs['ck']}/world.trained")
    assert (world_ckpt["layout"]["ep"], world_ckpt["layout"]["etp"]) == (2, 2)
    got = _tensors(world_ckpt)
    assert got.keys() == serial.keys()
    errs = {k: rel_err(got[k], t) for k, t in serial.items()}
    assert max(errs.values()) < 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:5]


def _same_run(resumed: dict, straight: dict, tag: str) -> None:
    steps = [(r["iteration"], r["loss"], r["grad_norm"]) for r in straight["records"][SAVED_AT:]]
    assert [(r["iteration"], r["loss"], r["grad_norm"]) for r in resumed["records"]] == steps, tag
    assert resumed["evals"][-1] == straight["evals"][-1], tag
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), f"{tag}: {name}"


def test_resume_at_the_same_layout_is_bitwise(runs):
    """Saved at iteration 2 and resumed to 4: the losses, grad norms, evaluation and weights of the run that
    never stopped, exactly (one process, and each rank of tp2 x etp2 x ep2 at ZeRO 3)."""
    _same_run(runs["resumed"], runs["straight"], "serial")
    for rank, per_rank in enumerate(runs["world"]):
        _same_run(per_rank["resumed"], per_rank["straight"], f"rank {rank}")


def _load_into(cfg, root: str) -> None:
    """Load ``root``'s weights into a fresh one-process model of ``cfg``."""
    pstate = ParallelState.serial()
    chunks = build_model_chunks(cfg, RunPlan.resolve(cfg, 1), pstate)
    folder = storage.resolve(root)
    ckpt_load.load_model_weights(folder, storage.read_metadata(folder), chunks, pstate)


def _merge(cfg, root: str) -> None:
    """Merge ``cfg`` (its MoE flags given explicitly) with the checkpoint's model, as a resume does."""
    cfg = dataclasses.replace(cfg, explicit=frozenset({"num_experts", "moe_ffn_hidden_size"}))
    ckpt_load.merge_config(storage.read_metadata(storage.resolve(root)), cfg)


def test_dense_checkpoint_or_other_expert_count_is_one_line(runs, tmp_path):
    """A dense checkpoint into an MoE model, and a 4-expert one into an 8-expert model: one line each, from the
    flags (before any process group) and from the weights."""
    dense = str(tmp_path / "dense")
    serial_ckpt.save(dense, 1)
    moe4 = f"{runs['ck']}/serial"
    cases = [(moe_cfg(), dense, "holds a dense model without --num-experts, but this model has --num-experts 4",
              "--num-experts 4 contradicts the checkpoint's dense model (no --num-experts)"),
             (moe_cfg(experts=8), moe4, "holds --num-experts 4, but this model has --num-experts 8",
              "--num-experts 8 contradicts the checkpoint's 4")]
    for cfg, root, from_weights, from_flags in cases:
        with pytest.raises(ValueError, match=re.escape(from_weights)) as weights:
            _load_into(cfg, root)
        with pytest.raises(ConfigError, match=re.escape(from_flags)) as flags:
            _merge(cfg, root)
        for err in (weights, flags):
            assert "\n" not in str(err.value) and ("--num-experts" in str(err.value)), str(err.value)


def _shift_expert_region(meta: dict) -> None:
    """One ep rank's optimizer file claims the experts of the next ep rank (its own experts' state is gone)."""
    files = [info for info in meta["optimizer"]["files"].values() if info["regions"]]
    name = next(iter(files[0]["regions"]))
    files[0]["regions"][name] = files[1]["regions"][name]


def _drop_expert_file(meta: dict) -> None:
    """The experts of ep rank 1 are left out of the model index."""
    entry = next(e for n, e in meta["model"].items() if ".experts." in n)
    del entry["files"]["experts_etp00_ep01_pp00.safetensors"]


@pytest.mark.parametrize("edit, expect", [(_shift_expert_region, r"optimizer state of '.*experts.*a gap"),
                                          (_drop_expert_file, r"model tensor '.*experts.*a gap")])
def test_damaged_expert_index_is_one_line(runs, tmp_path, edit, expect):
    """An index whose expert regions leave experts uncovered fails before anything is read, naming the file."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(f"{runs['ck']}/ep4.z3", root)
    path = os.path.join(storage.resolve(root), storage.METADATA)
    meta = json.load(open(path))
    edit(meta)
    json.dump(meta, open(path, "w"))
    with pytest.raises(ValueError, match=expect) as info:
        storage.read_metadata(storage.resolve(root))
    assert path in str(info.value) and "\n" not in str(info.value), str(info.value)
