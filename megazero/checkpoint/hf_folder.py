"""Publish an HF export into its folder as one unit.

An export writes a single ``model.safetensors`` or ``model-0000i-of-0000n`` shards plus
``model.safetensors.index.json``. Written straight into a folder that holds an earlier export
in the other layout, both would stay: transformers prefers ``model.safetensors`` and megazero's
reader the index, so each would load other weights. So the export is written into a staging
folder inside the output (same filesystem, hidden from loaders), synced, and committed:

1. every weight entry point of the old export goes first (index files, then single files), so
   from here until step 3 the folder holds no loadable weights - a crash is a loud error;
2. the old export's other model files go (shards, config, tokenizer files the new export
   does not write), then the new non-entry files are renamed in;
3. the new entry point is renamed in last: the folder loads the new export, and only it.

Every file committed gets the mode the umask gives (``storage.shareable``), whoever wrote it.
Files a user put there that no export writes (a README, training notes) are left alone.
"""
from __future__ import annotations

import os
import re
import shutil

from .storage import fsync_path, shareable

STAGING_PREFIX = ".megazero-export-"
# Weight files transformers or megazero's reader would pick up, in any layout or format.
_WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
_ENTRY = re.compile(r"^(model\.safetensors|pytorch_model\.bin)(\.index\.json)?$")
# Files that describe the model or its tokenizer: an old copy beside new weights would mislead.
MODEL_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt"})


def is_model_file(name: str) -> bool:
    """True for a file an export owns: weights of any layout, config and tokenizer files."""
    return bool(_WEIGHTS.match(name)) or name in MODEL_FILES


def new_staging(out_dir: str) -> str:
    """A fresh staging folder inside ``out_dir``; stale ones of dead exports are removed first."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--output {out_dir!r} is a file; pass a folder for the HF model.")
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if name.startswith(STAGING_PREFIX) and not _alive(name[len(STAGING_PREFIX):].split("-")[0]):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    staging = os.path.join(out_dir, f"{STAGING_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
    os.makedirs(staging)
    return staging


def _alive(pid: str) -> bool:
    """Whether the export that made a staging folder still runs (on this host)."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def commit(staging: str, out_dir: str) -> list[str]:
    """Replace ``out_dir``'s model files by ``staging``'s (see the module docstring); returns what was removed."""
    new = sorted(os.listdir(staging))
    for name in new:  # written by safetensors, transformers, copies: each as the umask says (save_file gives 0600)
        shareable(os.path.join(staging, name))
        fsync_path(os.path.join(staging, name))
    entries = [n for n in new if _ENTRY.match(n)]
    assert len(entries) == 1, f"an export has one weight entry point, got {entries}"
    old = [n for n in os.listdir(out_dir) if is_model_file(n) and os.path.isfile(os.path.join(out_dir, n))]
    # indexes before single files, so no moment offers a reader an index without its shards
    doomed = sorted((n for n in old if _ENTRY.match(n)), key=lambda n: not n.endswith(".index.json"))
    doomed += [n for n in old if not _ENTRY.match(n) and n not in new]
    for name in doomed:
        os.remove(os.path.join(out_dir, name))
    for name in [n for n in new if n not in entries] + entries:  # the entry point last
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    fsync_path(out_dir)
    os.rmdir(staging)
    return [n for n in doomed if n not in new]
