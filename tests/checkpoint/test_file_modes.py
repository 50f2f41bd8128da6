"""Checkpoints and HF exports a team can share: every file and folder gets the mode the umask gives.

safetensors' ``save_file`` (and so transformers' ``save_pretrained``) writes 0600 whatever the umask.
Real runs throughout: pretrain_gpt.py on one rank with --save and with --async-save, then
tools/convert_checkpoint.py --to hf and back --to megazero, all under umask 022 (files 0644,
folders 0755) and, once, under umask 077 (0600 and 0700: the umask is honoured, not overridden).
"""
from __future__ import annotations

import os
import stat

import pytest

from megazero.checkpoint import storage
from tests.helpers.launch import ROOT, launch, run_python

TINY = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
        "--train-iters", "2", "--save-interval", "1", "--lr-warmup-iters", "1"]

# A rank of launch() may be a fork of the test forkserver, which keeps the umask it started with: the
# umask is set in the rank itself, as a shell's `umask 022` does before `python pretrain_gpt.py`.
UNDER_UMASK = """import os, runpy, sys
os.umask(int(sys.argv.pop(1), 8))
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def _train(tmp_path, umask: int, save: str, *flags: str) -> None:
    wrapper = tmp_path / "under_umask.py"
    wrapper.write_text(UNDER_UMASK.format(script=os.path.join(ROOT, "pretrain_gpt.py")))
    [rank] = launch(str(wrapper), [oct(umask), *TINY, "--save", save, *flags], nproc=1)
    assert rank.returncode == 0, rank.stderr[-3000:]


def _convert(umask: int, *args: str) -> None:
    previous = os.umask(umask)  # the forked child carries the caller's umask, as subprocess.run(umask=) set it
    try:
        done = run_python(["tools/convert_checkpoint.py", *args])
    finally:
        os.umask(previous)
    assert done.returncode == 0, done.stderr[-3000:]


def _modes(root: str) -> dict[str, tuple[int, int]]:
    """Path under ``root`` (``root`` itself as '.') -> (kind, permission bits), for every file and folder."""
    found = {".": (stat.S_IFDIR, stat.S_IMODE(os.stat(root).st_mode))}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(where, name)
            st = os.lstat(path)
            found[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode))
    return found


def _wrong(root: str, file_mode: int, dir_mode: int) -> list[str]:
    wrong = []
    for path, (kind, mode) in _modes(root).items():
        want = dir_mode if kind == stat.S_IFDIR else file_mode
        if kind not in (stat.S_IFDIR, stat.S_IFREG) or mode != want:
            wrong.append(f"{path}: {oct(mode)} (want {oct(want)})")
    return wrong


def test_umask_022_gives_files_0644_and_folders_0755(tmp_path) -> None:
    sync, async_, hf, back = (str(tmp_path / n) for n in ("sync", "async", "hf", "from_hf"))
    _train(tmp_path, 0o022, sync)
    _train(tmp_path, 0o022, async_, "--async-save")
    _convert(0o022, "--input", sync, "--output", hf, "--to", "hf")
    _convert(0o022, "--input", hf, "--output", back, "--to", "megazero")
    names = {os.path.basename(p) for p in _modes(sync)} | set(_modes(hf))
    # what each writer makes: shards and rng (save_file), metadata.json, latest, and the HF export's weights
    # (save_file), config (save_pretrained) and the default corpus's tokenizer (save_pretrained and a copy)
    for name in ("model_tp00_pp00.safetensors", "optim_tp00_pp00_dp00.safetensors", "rng_rank00000.safetensors",
                 "metadata.json", "latest", "iter_0000002", "model.safetensors", "config.json", "tokenizer.json",
                 "tokenizer.model"):
        assert name in names, sorted(names)
    for root in (sync, async_, hf, back):
        assert _wrong(root, 0o644, 0o755) == [], root


def test_umask_077_is_honoured(tmp_path) -> None:
    save, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    _train(tmp_path, 0o077, save)
    _convert(0o077, "--input", save, "--output", hf, "--to", "hf")
    for root in (save, hf):
        assert _wrong(root, 0o600, 0o700) == [], root


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_shareable_follows_the_umask_it_reads(tmp_path, umask) -> None:
    old = os.umask(umask)
    try:
        assert storage.current_umask() == umask
        path, folder = tmp_path / "f", tmp_path / "d"
        path.write_text("x")
        folder.mkdir()
        os.chmod(path, 0o600)
        os.chmod(folder, 0o700)
        storage.shareable(str(path))
        storage.shareable(str(folder))
        assert (stat.S_IMODE(path.stat().st_mode), stat.S_IMODE(folder.stat().st_mode)) == \
            (0o666 & ~umask, 0o777 & ~umask)
    finally:
        os.umask(old)
