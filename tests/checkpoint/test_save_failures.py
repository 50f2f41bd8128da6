"""A save that cannot write (a full disk) fails as one OSError on every rank and leaves nothing behind.

The full disk is RLIMIT_FSIZE on rank 1 of a real 2-rank gloo world (no root, no mount):
with SIGXFSZ ignored, a write past the limit fails with EFBIG, which safetensors reports
as its own SafetensorError. Every rank must raise an OSError naming the file (what
pretrain_gpt.py prints as one line), rank 0 must not hang waiting for rank 1, the failed
save's staging folder must be gone, and ``latest`` must still name the last good checkpoint.
"""
from __future__ import annotations

import errno
import os
import resource
import signal

import pytest

from megazero.checkpoint import storage
from megazero.checkpoint.save import CheckpointContext, save_checkpoint
from tests.helpers.dist import spawn
from tests.helpers.serial_ckpt import build, plan_of, save

LIMIT = 20_000  # bytes: above the RNG file, below an optimizer shard of the tiny model


def _save_on_a_full_disk(pstate, root: str, full_rank: int) -> tuple[str, int | None, str | None]:
    cfg, _, model = build(pstate=pstate, zero=1)  # each rank writes its shard
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if pstate.rank == full_rank:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, limits[1]))
    try:
        save_checkpoint(CheckpointContext(root, cfg, plan_of(cfg, pstate), pstate, model), 9, 0)
    except Exception as err:  # noqa: BLE001 - the test checks its type
        return type(err).__name__, getattr(err, "errno", None), str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return "saved", None, None


@pytest.mark.parametrize("full_rank,first_file", [(0, "model_tp00_pp00"), (1, "optim_tp00_pp00_dp01")])
def test_full_disk_fails_every_rank_with_one_oserror(tmp_path, full_rank, first_file):
    root = str(tmp_path / "ckpt")
    save(root, 5)
    results = spawn(_save_on_a_full_disk, 2, root, full_rank, timeout=120)
    for kind, code, message in results:
        assert kind == "OSError" and code == errno.EFBIG, results
        assert f"{first_file}.safetensors" in message and "\n" not in message, results
        assert "iteration 9 not saved" in message, results
    assert sorted(os.listdir(root)) == ["iter_0000005", "latest"], "the staging folder is removed"
    assert storage.read_metadata(storage.resolve(root))["iteration"] == 5
