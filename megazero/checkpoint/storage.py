"""Where checkpoints live on disk and how they are published atomically.

    DIR/latest                      "iter_0000010" - written last, by rename
    DIR/iter_0000010/metadata.json  config, layout, iteration, tensor index (written last inside)
    DIR/iter_0000010/model_tp00_pp00.safetensors
    DIR/iter_0000010/experts_etp00_ep01_pp00.safetensors   (MoE expert weights, by expert-grid rank)
    DIR/iter_0000010/optim_tp00_pp00_dp01.safetensors
    DIR/iter_0000010/rng_rank00003.safetensors

Every rank writes its files into ``iter_N.tmp-<stamp>/``; after a barrier rank 0
writes metadata.json there, renames the folder to ``iter_N`` and then
replaces ``latest``. A crash at any moment leaves ``latest`` naming the
previous complete checkpoint; half-written folders keep their ``.tmp`` name
and are ignored (and cleaned up by the next save). Re-saving an iteration
renames the old copy to ``iter_N.old-<stamp>`` first and deletes it only once
the new one is in place; until then ``resolve`` falls back to it. --keep-last
ranks checkpoints by save order (``saved_at``), never by iteration number.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from typing import Any

from .validate import check

FORMAT = "megazero-checkpoint"
VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
ASIDE = ".old-"  # iter_N.old-<stamp>: the previous copy of iter_N while a re-save of N is published


def iteration_dir(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def model_file(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.safetensors"


def expert_file(etp_rank: int, ep_rank: int, pp_rank: int) -> str:
    return f"experts_etp{etp_rank:02d}_ep{ep_rank:02d}_pp{pp_rank:02d}.safetensors"


def optim_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"optim_tp{tp_rank:02d}_pp{pp_rank:02d}_dp{dp_rank:02d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.safetensors"


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder: so the renames in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (``os.umask`` reads it only by
    setting it, a race with an --async-save writer thread creating files at the same moment)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # elsewhere: the strictest stand-in for the instant it is read
    os.umask(mask)
    return mask


def shareable(path: str) -> None:
    """Give a file (folder) megazero wrote the mode the umask gives a new one, 0o666 (0o777) & ~umask.

    safetensors' ``save_file`` (so transformers' ``save_pretrained``) and ``tempfile`` write 0600 whatever
    the umask: a checkpoint or export a team shares would be readable by its writer alone. A filesystem
    without modes (some network mounts) refuses the chmod; its files keep what it gives them."""
    base = 0o777 if os.path.isdir(path) else 0o666
    try:
        os.chmod(path, base & ~current_umask())
    except PermissionError:
        pass


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
    """Rank 0, after every rank's files are in ``staging``: rename into place, then point ``latest``.

    With ``keep_last``, rotates quietly; ``save_checkpoint`` calls ``rotate`` itself to report and protect.
    """
    final = os.path.join(root, iteration_dir(iteration))
    fsync_path(staging)
    aside = None
    if os.path.exists(final):  # re-saving an iteration: the old copy stays until the new one is in place
        aside = final + ASIDE + staging.rsplit(".tmp-", 1)[1]
        os.rename(final, aside)  # a crash from here on: resolve() falls back to the aside copy
    os.rename(staging, final)
    fsync_path(root)
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(iteration_dir(iteration) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_path(root)
    if aside is not None:
        shutil.rmtree(aside)
    _clean(root)
    if keep_last:
        rotate(root, keep_last)
    return final


def _clean(root: str) -> None:
    """Drop abandoned staging folders and restore or drop the aside copies of interrupted re-saves."""
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


def saved_at(folder: str) -> float:
    """When a checkpoint was saved (ms): its metadata's ``saved_at``, else (older ones) the metadata's mtime."""
    path = os.path.join(folder, METADATA)
    try:
        with open(path) as fh:
            stamp = json.load(fh).get("saved_at")
        if isinstance(stamp, int) and not isinstance(stamp, bool):
            return float(stamp)
        return os.path.getmtime(path) * 1000
    except (OSError, ValueError, AttributeError):  # unreadable: its folder's mtime
        return os.path.getmtime(folder) * 1000


def latest_target(root: str) -> str | None:
    """The folder ``root/latest`` names, or None when there is none to read."""
    try:
        with open(os.path.join(root, LATEST)) as fh:
            name = fh.read().strip()
    except (OSError, ValueError):
        return None
    return os.path.join(root, name) if name else None


def rotate(root: str, keep_last: int, protect: tuple[str, ...] = ()) -> list[str]:
    """--keep-last K: remove all but the K most recently *saved* checkpoints; returns the removed names.

    Save order, not iteration numbers: a run resumed from an earlier iteration (a rollback) saves
    lower numbers than the ones it leaves behind, and those new checkpoints are what it must keep.
    What ``latest`` names and the folders in ``protect`` (what the run loaded) are never removed;
    nothing but ``iter_NNNNNNN`` folders is ever touched (a lock file or the user's notes stay).
    """
    done = [n for n in os.listdir(root) if re.fullmatch(r"iter_\d{7}", n) and os.path.isdir(os.path.join(root, n))]
    order = sorted(done, key=lambda n: (saved_at(os.path.join(root, n)), n))
    kept = {os.path.realpath(p) for p in (*protect, latest_target(root)) if p}
    removed = [n for n in order[:-keep_last] if os.path.realpath(os.path.join(root, n)) not in kept]
    for name in removed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed


def resolve(path: str, flag: str = "--load") -> str:
    """The checkpoint folder for ``--load PATH``: PATH itself, or what PATH/latest names (errors name ``flag``,
    the option that gave PATH: a tool reading a checkpoint takes it as ``--input``)."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest) and is_hf_folder(path):
        target = shlex.quote(path.rstrip("/") + "-megazero")
        raise ValueError(f"{flag} {path!r} is an HF transformers model folder, not a megazero checkpoint; convert it "
                         f"first: .venv/bin/python tools/convert_checkpoint.py --input {shlex.quote(path)} --output "
                         f"{target} --to megazero, and pass its --output as {flag}.")
    if not os.path.isfile(latest):
        raise ValueError(f"{flag} {path!r} holds no checkpoint (no {LATEST} file and no {METADATA}); "
                         f"pass the --save folder of an earlier run.")
    try:
        with open(latest) as fh:
            name = fh.read().strip()
    except (OSError, ValueError) as err:
        raise ValueError(f"{latest!r} is unreadable ({err}); point {flag} at an iter_* folder.") from None
    if not re.fullmatch(r"iter_\d{7}", name):
        raise ValueError(f"{latest!r} names {name[:80]!r}, not an iter_NNNNNNN folder; "
                         f"point {flag} at an iter_* folder.")
    folder = os.path.join(path, name)
    if not os.path.isfile(os.path.join(folder, METADATA)):  # a crash while re-saving it: the old copy, aside
        asides = sorted(n for n in os.listdir(path) if n.startswith(name + ASIDE))
        folder = os.path.join(path, asides[-1]) if asides else folder
    if not os.path.isfile(os.path.join(folder, METADATA)):
        what = "which is missing" if not os.path.exists(folder) else f"which has no {METADATA}"
        raise ValueError(f"{latest!r} names {folder!r}, {what}; the checkpoint is gone or incomplete - "
                         f"point {flag} at an earlier iter_* folder.")
    return folder


def is_hf_folder(path: str) -> bool:
    """A folder as transformers' ``save_pretrained`` writes it: config.json beside safetensors weights."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def read_metadata(folder: str) -> dict[str, Any]:
    """The metadata of a checkpoint folder, checked (``validate.check``): one ValueError naming the file."""
    path = os.path.join(folder, METADATA)
    try:
        with open(path) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as err:  # ValueError: invalid JSON or not UTF-8
        raise ValueError(f"checkpoint metadata {path!r} is unreadable ({err}); load an earlier checkpoint.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        got = meta if not isinstance(meta, dict) else {k: meta.get(k) for k in ("format", "version")}
        raise ValueError(f"{path!r} is not a megazero v{VERSION} checkpoint ({str(got)[:120]}).")
    check(meta, path)
    return meta


def metadata_dict(*, config: dict[str, Any], layout: dict[str, Any], iteration: int, consumed_samples: int,
                  model: dict[str, Any], optimizer_scalars: dict[str, Any],
                  optimizer_files: dict[str, Any], rng_files: bool) -> dict[str, Any]:
    """The one schema of metadata.json (written by save and by the converters)."""
    return {"format": FORMAT, "version": VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
            "config": config, "layout": layout, "model": model, "rng_files": rng_files,
            "optimizer": {"scalars": optimizer_scalars, "files": optimizer_files}}
