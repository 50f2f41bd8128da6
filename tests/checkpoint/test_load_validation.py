"""A checkpoint is checked before it is trusted: one ValueError naming the file, on every rank.

One ZeRO-1 checkpoint saved by a real 2-rank gloo world (so each DP rank wrote its own
optimizer shard) is copied and damaged one way per case:

- metadata edits (a shard left out of the index, overlapping or missing pieces, a negative
  step, a zero loss scale, a string iteration, a missing key, invalid JSON, a ``latest``
  naming a deleted folder) fail in ``storage.resolve``/``read_metadata``, which every rank
  calls before any collective;
- shard edits (a NaN master weight, a negative second moment) are read by one rank only
  (rank 1 loads DP shard 1): both ranks must still raise, naming the file, and neither hang.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from megazero.checkpoint import storage
from megazero.checkpoint.load import load_optimizer_state
from megazero.checkpoint.save import CheckpointContext, save_checkpoint
from tests.helpers.dist import spawn
from tests.helpers.serial_ckpt import build, plan_of


def _save(pstate, root: str) -> None:
    cfg, _, model = build(pstate=pstate, zero=1)
    save_checkpoint(CheckpointContext(root, cfg, plan_of(cfg, pstate), pstate, model), 3, 24)


def _load(pstate, root: str) -> str:
    folder = storage.resolve(root)
    meta = storage.read_metadata(folder)
    try:
        _, _, model = build(pstate=pstate, zero=1, weights=(folder, meta))
        load_optimizer_state(folder, meta, model, pstate)
    except ValueError as err:
        return str(err)
    return "loaded"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("dp2") / "ckpt")
    spawn(_save, 2, root)
    return root


def _copy(saved: str, tmp_path) -> tuple[str, str, dict]:
    root = str(tmp_path / "ckpt")
    shutil.copytree(saved, root)
    meta_path = os.path.join(root, "iter_0000003", "metadata.json")
    return root, meta_path, json.load(open(meta_path))


def _drop_shard(meta):
    del meta["optimizer"]["files"]["optim_tp00_pp00_dp01.safetensors"]


def _overlap(meta):
    """DP shard 1 claims part of a piece DP shard 0 holds."""
    files = meta["optimizer"]["files"]
    name, (lo, hi) = next((n, r) for n, r in files["optim_tp00_pp00_dp00.safetensors"]["ranges"].items()
                          if r[1] - r[0] >= 2)
    files["optim_tp00_pp00_dp01.safetensors"]["ranges"][name] = [lo + 1, hi]


def _gap_in_model(meta):
    entry = meta["model"]["final_norm.weight"]
    entry["files"]["model_tp00_pp00.safetensors"] = [[1, entry["shape"][0]]]


def _no_optimizer_files(meta):
    meta["optimizer"]["files"] = {}  # as a converted checkpoint has, but this one trained 3 steps


def _set(path: list[str], value):
    def edit(meta):
        node = meta
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


CASES = {
    "unlisted optimizer shard": (_drop_shard, "optimizer state of"),
    "overlapping optimizer ranges": (_overlap, "overlap|outside"),
    "model piece missing": (_gap_in_model, "gap"),
    "optimizer files emptied": (_no_optimizer_files, "optimizer"),
    "negative step": (_set(["optimizer", "scalars", "step"], -4), "step"),
    "zero loss scale": (_set(["optimizer", "scalars", "scaler"], {"scale": 0.0, "clean_steps": 0}), "loss scale"),
    "iteration not an integer": (_set(["iteration"], "3"), "'iteration'"),
    "negative consumed samples": (_set(["consumed_samples"], -8), "consumed_samples"),
    "missing key": (lambda meta: meta.pop("layout"), "'layout' is missing"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_metadata_is_one_line_naming_the_file(saved, tmp_path, case):
    root, meta_path, meta = _copy(saved, tmp_path)
    edit, expect = CASES[case]
    edit(meta)
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(ValueError, match=expect) as info:
        storage.read_metadata(storage.resolve(root))
    assert meta_path in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_unparseable_metadata_and_latest(saved, tmp_path):
    root, meta_path, _ = _copy(saved, tmp_path)
    open(meta_path, "w").write('{"format": "megazero-checkpoint", "version": 1, "iteration": ')
    with pytest.raises(ValueError, match="unreadable") as info:
        storage.read_metadata(storage.resolve(root))
    assert meta_path in str(info.value)
    shutil.rmtree(os.path.join(root, "iter_0000003"))
    with pytest.raises(ValueError, match="which is missing") as info:
        storage.resolve(root)
    assert os.path.join(root, "latest") in str(info.value)


def _nan_master(tensors):
    key = next(k for k in tensors if k.endswith("/master"))
    tensors[key][0] = float("nan")


def _negative_moment(tensors):
    key = next(k for k in tensors if k.endswith("/exp_avg_sq"))
    tensors[key][0] = -1.0


@pytest.mark.parametrize("damage,expect", [(_nan_master, "NaN/inf"), (_negative_moment, "negative second")],
                         ids=["nan-master", "negative-exp-avg-sq"])
def test_damaged_shard_read_by_one_rank_fails_every_rank(saved, tmp_path, damage, expect):
    root, _, _ = _copy(saved, tmp_path)
    assert spawn(_load, 2, root, timeout=120) == ["loaded", "loaded"], "control: the undamaged copy loads"
    shard = os.path.join(root, "iter_0000003", "optim_tp00_pp00_dp01.safetensors")
    tensors = load_file(shard)
    damage(tensors)
    save_file(tensors, shard)
    messages = spawn(_load, 2, root, timeout=120)
    for message in messages:
        assert shard in message and expect in message, messages
