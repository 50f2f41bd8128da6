"""--async-save: the same files as a synchronous save, an exact resume, and no published half-checkpoint.

Real worlds throughout: pretrain_gpt.py on 2 gloo ranks (ZeRO 1, so both ranks write an optimizer
shard) for the files and the resume; a SIGKILLed process for a crash in the background write; a
2-rank spawn world with a full disk on one rank for a failed background write.
"""
from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from megazero.checkpoint import storage
from tests.helpers.async_ckpt import saver_for
from tests.helpers.dist import spawn
from tests.helpers.launch import ROOT, train_records
from tests.helpers.serial_ckpt import load, save

TINY = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--adam-eps", "1e-4", "--zero", "1", "--bucket-size", "20000"]
STEPS = ["--train-iters", "4", "--save-interval", "2"]


def _steps(records: list[dict]) -> list[tuple]:
    return [(r["iteration"], r["consumed_samples"], r["loss"], r["grad_norm"]) for r in records]


def _files(folder: str) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def _metadata_but_when_and_how(raw: bytes) -> dict:
    """The metadata but for when it was saved, by which run, and the flags the two runs differ in."""
    meta = json.loads(raw)
    meta.pop("saved_at")
    meta.pop("run_id")
    for key in ("async_save", "save", "metrics_file"):
        meta["config"].pop(key)
    return meta


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    sync = train_records(tmp / "sync.jsonl", [*TINY, *STEPS, "--save", str(tmp / "sync")], 2, default_corpus=True)
    asynchronous = train_records(tmp / "async.jsonl", [*TINY, *STEPS, "--save", str(tmp / "async"),
                                                       "--async-save"], 2, default_corpus=True)
    return tmp, sync, asynchronous


def test_async_files_equal_sync_files(runs):
    """Training is untouched by the background writes, and every checkpoint file is the same, byte for byte."""
    tmp, sync, asynchronous = runs
    assert _steps(asynchronous) == _steps(sync)
    assert sorted(os.listdir(tmp / "async")) == ["config.yaml", "iter_0000002", "iter_0000004", "latest"]  # published
    assert open(tmp / "async" / "latest").read().strip() == "iter_0000004"
    for it in ("iter_0000002", "iter_0000004"):
        want, got = _files(str(tmp / "sync" / it)), _files(str(tmp / "async" / it))
        assert sorted(got) == sorted(want) and len(got) == 6  # model, 2 optimizer shards, 2 rng, metadata
        meta_want, meta_got = want.pop(storage.METADATA), got.pop(storage.METADATA)
        assert got == want, it
        assert _metadata_but_when_and_how(meta_got) == _metadata_but_when_and_how(meta_want)
        assert json.loads(meta_got)["optimizer"]["scalars"]["step"] == int(it[-1])  # scalars of the saved step


def test_resume_from_async_equals_resume_from_sync(runs):
    tmp, sync, _ = runs
    resumed = {name: train_records(tmp / f"resumed-{name}.jsonl",
                                   [*TINY, "--train-iters", "4", "--load", str(tmp / name / "iter_0000002")], 2,
                                   default_corpus=True)
               for name in ("sync", "async")}
    assert _steps(resumed["async"]) == _steps(resumed["sync"]) == _steps(sync[2:])  # bitwise on CPU


def test_crash_in_background_write_keeps_last_good_checkpoint(tmp_path):
    """SIGKILL while the writer is half way through: the step had already returned, nothing was published."""
    root = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.async_ckpt", root], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        seen = [proc.stdout.readline().strip(), proc.stdout.readline().strip()]
    finally:
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.wait()
    assert seen == ["SAVE-RETURNED", "HALF-WRITTEN"]
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000005"
    staged = [n for n in os.listdir(root) if n.startswith("iter_0000009.tmp-")]
    assert len(staged) == 1 and storage.METADATA not in os.listdir(os.path.join(root, staged[0]))
    assert storage.read_metadata(storage.resolve(root))["iteration"] == 5
    load(root)
    save(root, 11)  # the next save publishes and sweeps the abandoned staging folder
    assert sorted(os.listdir(root)) == ["iter_0000005", "iter_0000011", "latest"]


LIMIT = 20_000  # bytes: above the RNG file, below an optimizer shard of the tiny model


def _async_save_on_a_full_disk(pstate, root: str) -> tuple[str, int | None, str | None, str | None]:
    saver = saver_for(root, pstate, zero=1)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if pstate.rank == 1:  # the background writer of rank 1 hits the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, limits[1]))
    try:
        saver.save(9, 0)
        latest_meanwhile = open(os.path.join(root, "latest")).read().strip()
        while saver.pending is not None:  # every rank polls in step until all writers are done
            saver.poll()
    except Exception as err:  # noqa: BLE001 - the test checks its type
        return type(err).__name__, getattr(err, "errno", None), str(err), latest_meanwhile
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return "saved", None, None, latest_meanwhile


def test_failed_background_write_fails_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    save(root, 5)
    results = spawn(_async_save_on_a_full_disk, 2, root, timeout=120)
    for kind, code, message, latest_meanwhile in results:
        assert kind == "OSError" and code == errno.EFBIG, results
        assert "optim_tp00_pp00_dp01.safetensors" in message and "iteration 9 not saved" in message, results
        assert latest_meanwhile == "iter_0000005"
    assert sorted(os.listdir(root)) == ["iter_0000005", "latest"], "the staging folder is removed"
    assert storage.read_metadata(storage.resolve(root))["iteration"] == 5
