"""--keep-last keeps the most recently saved checkpoints, never what ``latest`` names or what the run loaded.

The rollback a user makes after a loss spike: checkpoints at 2, 4, 6, 8; the run is resumed
from iteration 4 (``--load DIR/iter_0000004``) and saves 5 and 6 (6 again) with --keep-last 2.
Ranking by iteration number would delete 5, 6 and 4 and leave ``latest`` naming a deleted
folder; ranking by save order keeps 5 and the new 6, and 4 because the run loaded it.
"""
from __future__ import annotations

import json
import os

from megazero.checkpoint import storage
from tests.helpers.launch import launch

TINY = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1"]


def _run(flags: list[str]) -> str:
    result = launch("pretrain_gpt.py", [*TINY, *flags], 1)[0]
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _iters(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("iter_"))


def test_rollback_keeps_the_new_and_the_loaded_checkpoints(tmp_path):
    root = str(tmp_path / "ckpt")
    _run(["--train-iters", "8", "--save", root, "--save-interval", "2"])
    assert _iters(root) == ["iter_0000002", "iter_0000004", "iter_0000006", "iter_0000008"]
    six = os.path.join(root, "iter_0000006", "metadata.json")
    first_six = os.stat(six).st_mtime_ns
    for name in (".other-tool.lock", "NOTES.txt"):  # files that are not checkpoints: never touched
        open(os.path.join(root, name), "w").write("x")

    out = _run(["--train-iters", "6", "--load", os.path.join(root, "iter_0000004"), "--save", root,
                "--save-interval", "1", "--keep-last", "2"])
    assert _iters(root) == ["iter_0000004", "iter_0000005", "iter_0000006"]
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000006"
    assert os.stat(six).st_mtime_ns > first_six, "iteration 6 is the re-saved copy"
    removed = [line for line in out.splitlines() if "--keep-last 2: removed" in line]
    assert removed == ["megazero: --keep-last 2: removed iter_0000002, iter_0000006",
                       "megazero: --keep-last 2: removed iter_0000008"], out
    others = {n for n in os.listdir(root) if not n.startswith("iter_")}
    assert {".other-tool.lock", "NOTES.txt", "latest"} <= others, others
    out = _run(["--train-iters", "7", "--load", root])  # latest still leads to a complete checkpoint
    assert "(iteration 6)" in out


def test_old_checkpoints_rank_by_metadata_mtime(tmp_path):
    """Checkpoints saved before ``saved_at`` existed rank by their metadata's mtime, not their number."""
    root = str(tmp_path)
    for age, name in enumerate(["iter_0000009", "iter_0000003", "iter_0000005"]):  # saved in this order
        os.makedirs(os.path.join(root, name))
        meta = os.path.join(root, name, "metadata.json")
        json.dump({"iteration": int(name[5:])}, open(meta, "w"))
        os.utime(meta, (1_000_000 + age, 1_000_000 + age))
    open(os.path.join(root, "latest"), "w").write("iter_0000003\n")  # rolled back by hand
    assert storage.rotate(root, 1) == ["iter_0000009"]
    assert _iters(root) == ["iter_0000003", "iter_0000005"]
