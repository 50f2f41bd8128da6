"""Publishing never loses the last good checkpoint, and no checkpoint ever holds non-finite values.

The crash tests make ``os.rename`` fail at one chosen call inside ``storage.publish``
(a crash between its steps) and check that ``latest`` still leads to a complete,
loadable checkpoint. The non-finite tests save from a real 2-rank gloo world in
which only one rank holds a NaN: every rank must refuse, and nothing is published.
"""
from __future__ import annotations

import os

import pytest
import torch

from megazero.checkpoint import storage
from megazero.checkpoint.save import CheckpointContext, save_checkpoint
from tests.helpers.dist import spawn
from tests.helpers.serial_ckpt import build, load, plan_of, save


def _fail_rename_at(monkeypatch, call: int) -> None:
    """Make the ``call``-th os.rename from now on raise, as a crash at that point would stop publish."""
    real, count = os.rename, [0]

    def rename(src, dst, *args, **kwargs):
        count[0] += 1
        if count[0] == call:
            raise OSError(f"simulated crash at rename #{call}: {src} -> {dst}")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)


@pytest.mark.parametrize("call", [1, 2])
def test_resaving_an_iteration_survives_a_crash_between_renames(tmp_path, monkeypatch, call):
    """Re-saving iteration 2 (e.g. after a resume): a crash at either rename leaves iteration 2 loadable."""
    root = str(tmp_path / "ckpt")
    save(root, 1)
    save(root, 2)
    _fail_rename_at(monkeypatch, call)
    with pytest.raises(OSError, match="simulated crash"):
        save(root, 2)
    monkeypatch.undo()
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000002"
    folder = storage.resolve(root)
    assert storage.read_metadata(folder)["iteration"] == 2
    load(root)
    save(root, 3)  # the next publish tidies up: one copy of each iteration, no leftovers
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]
    assert storage.read_metadata(os.path.join(root, "iter_0000002"))["iteration"] == 2


def _save_with_nan(pstate, root: str, where: str, bad_rank: int) -> str:
    """One rank puts a NaN into the model weights or an inf into the Adam moments it writes; all save."""
    cfg, _, model = build(pstate=pstate, zero=1)  # each DP rank writes its shard
    if pstate.rank == bad_rank:
        with torch.no_grad():
            if where == "model":  # DP rank 0 writes the model weights
                next(model.chunks[0].parameters())[0] = float("nan")
            else:
                _, _, views = next(iter(model.optimizer.state_segments()))
                views["exp_avg_sq"][0] = float("inf")
    try:
        save_checkpoint(CheckpointContext(root, cfg, plan_of(cfg, pstate), pstate, model), 7, 0)
    except ValueError as err:
        return str(err)
    return "saved"


@pytest.mark.parametrize("where,bad_rank", [("model", 0), ("optimizer", 1)])
def test_non_finite_save_is_refused_on_every_rank(tmp_path, where, bad_rank):
    root = str(tmp_path / "ckpt")
    save(root, 5)
    messages = spawn(_save_with_nan, 2, root, where, bad_rank)
    for message in messages:
        assert "iteration 7" in message and "non-finite" in message, messages
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000005"
    assert sorted(os.listdir(root)) == ["iter_0000005", "latest"], "staging folder removed, nothing published"
    load(root)
