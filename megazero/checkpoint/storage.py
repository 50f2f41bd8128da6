"""Where checkpoints live on disk and how they are published atomically.

    DIR/latest                      "iter_0000010" - written last, by rename
    DIR/iter_0000010/metadata.json  config, layout, iteration, tensor index (written last inside)
    DIR/iter_0000010/model_tp00_pp00.safetensors
    DIR/iter_0000010/optim_tp00_pp00_dp01.safetensors
    DIR/iter_0000010/rng_rank00003.safetensors

Every rank writes its files into ``iter_N.tmp-<stamp>/``; after a barrier rank 0
writes metadata.json there, renames the folder to ``iter_N`` and then
replaces ``latest``. A crash at any moment leaves ``latest`` naming the
previous complete checkpoint; half-written folders keep their ``.tmp`` name
and are ignored (and cleaned up by the next save). Re-saving an iteration
renames the old copy to ``iter_N.old-<stamp>`` first and deletes it only once
the new one is in place; until then ``resolve`` falls back to it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

FORMAT = "megazero-checkpoint"
VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
ASIDE = ".old-"  # iter_N.old-<stamp>: the previous copy of iter_N while a re-save of N is published


def iteration_dir(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def model_file(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.safetensors"


def optim_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"optim_tp{tp_rank:02d}_pp{pp_rank:02d}_dp{dp_rank:02d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.safetensors"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def staging_dir(root: str, iteration: int, stamp: str) -> str:
    return os.path.join(root, f"{iteration_dir(iteration)}.tmp-{stamp}")


def publish(root: str, staging: str, iteration: int, keep_last: int | None) -> str:
    """Rank 0, after every rank's files are in ``staging``: rename into place, then point ``latest``."""
    final = os.path.join(root, iteration_dir(iteration))
    _fsync_dir(staging)
    aside = None
    if os.path.exists(final):  # re-saving an iteration: the old copy stays until the new one is in place
        aside = final + ASIDE + staging.rsplit(".tmp-", 1)[1]
        os.rename(final, aside)  # a crash from here on: resolve() falls back to the aside copy
    os.rename(staging, final)
    _fsync_dir(root)
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(iteration_dir(iteration) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside)
    _clean(root, keep_last)
    return final


def _clean(root: str, keep_last: int | None) -> None:
    """Drop abandoned staging folders and, with --keep-last K, all but the newest K checkpoints."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if ".tmp-" in name:
            shutil.rmtree(path, ignore_errors=True)
        elif ASIDE in name:  # left by a crash mid-publish: restore it if it is the only copy, else drop it
            base = path.split(ASIDE)[0]
            if os.path.isfile(os.path.join(base, METADATA)):
                shutil.rmtree(path, ignore_errors=True)
            elif not os.path.exists(base):
                os.rename(path, base)
    names = os.listdir(root)
    if keep_last:
        done = sorted(n for n in names if re.fullmatch(r"iter_\d{7}", n))
        for name in done[:-keep_last]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def resolve(path: str) -> str:
    """The checkpoint folder for ``--load PATH``: PATH itself, or what PATH/latest names."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        raise ValueError(f"--load {path!r} holds no checkpoint (no {LATEST} file and no {METADATA}); "
                         f"pass the --save folder of an earlier run.")
    folder = os.path.join(path, open(latest).read().strip())
    if not os.path.isfile(os.path.join(folder, METADATA)):  # a crash while re-saving it: the old copy, aside
        asides = sorted(n for n in os.listdir(path) if n.startswith(os.path.basename(folder) + ASIDE))
        folder = os.path.join(path, asides[-1]) if asides else folder
    if not os.path.isfile(os.path.join(folder, METADATA)):
        raise ValueError(f"--load {path!r}: {LATEST} names {folder!r}, which has no {METADATA}; "
                         f"the checkpoint is incomplete - point --load at an earlier iter_* folder.")
    return folder


def read_metadata(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, METADATA)
    try:
        with open(path) as fh:
            meta = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint metadata {path!r} is unreadable ({err}); load an earlier checkpoint.")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{path!r} is not a megazero v{VERSION} checkpoint "
                         f"(format={meta.get('format')!r}, version={meta.get('version')!r}).")
    return meta


def metadata_dict(*, config: dict[str, Any], layout: dict[str, Any], iteration: int, consumed_samples: int,
                  model: dict[str, Any], optimizer_scalars: dict[str, Any],
                  optimizer_files: dict[str, Any], rng_files: bool) -> dict[str, Any]:
    """The one schema of metadata.json (written by save and by the converters)."""
    return {"format": FORMAT, "version": VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
            "config": config, "layout": layout, "model": model, "rng_files": rng_files,
            "optimizer": {"scalars": optimizer_scalars, "files": optimizer_files}}
