"""What --load takes from a checkpoint besides the model: the data and the tokenizer it was trained with.

A run records its whole config in metadata.json, data flags included, so a resume, a --finetune or a
--skip-train that names no data reads the checkpoint's token files (blend weights in --data-path), its
--split and its tokenizer; a data flag given (typed or in the preset) wins, and one line says it differs.
A recorded file that no longer exists is refused in one line naming it and the flag to pass.

Every checkpoint also holds a copy of its tokenizer in its own ``tokenizer/`` folder (``metadata.json``'s
``tokenizer`` names it relative to the checkpoint, so the copy moves with the folder): a run's save copies
the --tokenizer-model it read, ``convert_checkpoint.py --to megazero`` the HF folder's. The recorded path
is read while it exists, the copy after. A checkpoint converted from HF (no RNG files) records no data; the
built-in corpus is tokenized by megazero's own tokenizer, so it is read only when nothing names another.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable

from ..config import Config, ConfigError, flag
from ..data.blend import parse_data_path
from ..data.tokenizer import load_tokenizer, resolve_tokenizer
from . import storage

TOKENIZER_DIR = "tokenizer"  # inside a checkpoint folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # what megazero reads (data/tokenizer.py)
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


def copy_hf_tokenizer(hf_dir: str, staging: str, vocab_size: int | None,
                      log: Callable[[str], None]) -> dict | None:
    """Copy an HF folder's tokenizer into a checkpoint being written (``staging``); returns the metadata's
    ``tokenizer`` entry, or None (and one line why) when the folder holds none megazero can use."""
    names = [n for n in (*TOKENIZER_FILES, *COMPANIONS) if os.path.isfile(os.path.join(hf_dir, n))]
    if not any(n in TOKENIZER_FILES for n in names):
        log(f"note: {hf_dir} holds no tokenizer.json or tokenizer.model; the checkpoint records no tokenizer "
            f"(pass --tokenizer-model to the runs that load it)")
        return None
    try:
        vocab = load_tokenizer(hf_dir).vocab_size
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own types for a file it cannot read
        log(f"note: the tokenizer of {hf_dir} is not recorded: {str(err).splitlines()[0][:200]}")
        return None
    if vocab_size is not None and vocab > vocab_size:
        log(f"note: the tokenizer of {hf_dir} ({vocab} tokens) exceeds the model's vocabulary ({vocab_size}); "
            f"not recorded")
        return None
    folder = os.path.join(staging, TOKENIZER_DIR)
    os.makedirs(folder)
    for name in names:
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(folder, name))
    return {"path": TOKENIZER_DIR, "type": resolve_tokenizer(folder)[0]}


def copy_run_tokenizer(cfg: Config, staging: str) -> dict[str, Any]:
    """A save's metadata entry for the copy of the run's --tokenizer-model it puts in ``staging`` (rank 0);
    {} for the built-in corpus's (rebuilt the same from the standard library) or one that has gone since."""
    if cfg.data.tokenizer_model is None:
        return {}
    try:
        kind, file = resolve_tokenizer(cfg.data.tokenizer_model, cfg.data.tokenizer_type)
        folder = os.path.join(staging, TOKENIZER_DIR)
        os.makedirs(folder)
        shutil.copyfile(file, os.path.join(folder, TOKENIZER_FILES[0] if kind == "hf" else TOKENIZER_FILES[1]))
        beside = os.path.dirname(os.path.abspath(file))
        for name in COMPANIONS if kind == "hf" else ():  # the special tokens transformers and megazero read
            if os.path.isfile(os.path.join(beside, name)):
                shutil.copyfile(os.path.join(beside, name), os.path.join(folder, name))
    except (OSError, ValueError):
        shutil.rmtree(os.path.join(staging, TOKENIZER_DIR), ignore_errors=True)
        return {}
    return {"tokenizer": {"path": TOKENIZER_DIR, "type": kind}}


def recorded_tokenizer(folder: str, meta: dict[str, Any]) -> tuple[str | None, str | None]:
    """(path, type) of the tokenizer the checkpoint was trained with: the path its config names while it
    exists, else the copy inside the checkpoint; (None, None): the built-in corpus's (a run), or none (an import).
    A path that has gone, with no copy, is returned as it is (``merge_data`` refuses it)."""
    named = meta["config"].get("tokenizer_model"), meta["config"].get("tokenizer_type")
    copy = _copy_of(folder, meta)
    if named[0] and (os.path.exists(named[0]) or copy is None):
        return named
    return copy or (None, None)


def _copy_of(folder: str, meta: dict[str, Any]) -> tuple[str, str | None] | None:
    entry = meta.get("tokenizer")
    if entry is None:
        return None
    path = entry.get("path") if isinstance(entry, dict) else None
    if not isinstance(path, str) or not path or os.path.isabs(path) or ".." in path.split("/"):
        raise ValueError(f"checkpoint metadata {os.path.join(folder, storage.METADATA)!r} names tokenizer "
                         f"{entry!r}, not a folder inside the checkpoint; load an earlier checkpoint.")
    return os.path.join(folder, path), entry.get("type")


def converted(meta: dict[str, Any]) -> bool:
    """Made by a converter (weights only, no generators), so its config records no training data."""
    return not meta.get("rng_files", meta["optimizer"]["files"])


def merge_data(found: tuple[str, dict[str, Any]], cfg: Config, check_files: bool = True) -> tuple[Config, list[str]]:
    """``cfg`` with the checkpoint's data and tokenizer where no flag gives them, and the lines to print:
    what was taken (for the model settings line) and each given setting that differs from the checkpoint's.
    ``check_files``: refuse a taken file that no longer exists (--dry-run reads no data: it does not)."""
    folder, meta = found
    given, run = cfg.explicit, cfg.to_flat()
    saved, load = meta["config"], cfg.checkpoint.load
    tokenizer, kind = recorded_tokenizer(folder, meta)
    merged: dict[str, Any] = {}
    notes: list[str] = []
    if "tokenizer_model" not in given:
        merged["tokenizer_model"] = tokenizer
        if "tokenizer_type" not in given:
            merged["tokenizer_type"] = kind
        if tokenizer and check_files and not os.path.exists(tokenizer):
            raise ConfigError(f"--load {load}: the checkpoint's tokenizer {tokenizer!r} no longer exists; pass "
                              f"--tokenizer-model with the tokenizer it was trained with.")
    elif (tokenizer or not converted(meta)) and not any(_same(run["tokenizer_model"], known) for known in
                                                         (tokenizer, saved.get("tokenizer_model"))):
        notes.append(f"megazero: --tokenizer-model {run['tokenizer_model']} differs from the checkpoint's "
                     f"({tokenizer or 'the built-in corpus tokenizer'}); using the one given")
    if converted(meta):
        if "data_path" not in given and (merged.get("tokenizer_model") or run["tokenizer_model"]):
            raise ConfigError(f"--load {load} was converted from HF and records no training data, and the built-in "
                              f"corpus is not tokenized with its tokenizer; pass --data-path with token files that "
                              f"tools/preprocess_data.py made with --tokenizer-model "
                              f"{merged.get('tokenizer_model') or run['tokenizer_model']}.")
        if not (merged.get("tokenizer_model") or run["tokenizer_model"] or "data_path" in given):
            notes.append(f"megazero: --load {load} was converted from HF and records no data or tokenizer: reading "
                         f"the built-in corpus with its tokenizer (pass --data-path and --tokenizer-model for "
                         f"others)")
        return cfg.updated(**merged) if merged else cfg, notes
    for key in ("data_path", "split"):
        if key not in given:
            merged[key] = saved.get(key, run[key])
        elif key in saved and saved[key] != run[key]:
            shown = " ".join(saved[key]) if key == "data_path" and saved[key] else saved[key] or "the built-in corpus"
            notes.append(f"megazero: {flag(key)} {_value(run[key])} differs from the checkpoint's ({shown}); "
                         f"using the one given")
    if "data_path" not in given and "data_cache_path" not in given:
        merged["data_cache_path"] = saved.get("data_cache_path")
    if merged.get("data_path") and check_files:
        _check_prefixes(merged["data_path"], load)
    return cfg.updated(**merged), notes


def data_text(cfg: Config) -> str:
    """What the settings line says of the data and the tokenizer a --load run reads (after ``merge_data``)."""
    d = cfg.data
    data = " ".join(d.data_path) if d.data_path else "the built-in corpus"
    tokenizer = d.tokenizer_model or "the built-in corpus tokenizer"
    data_from = "given" if "data_path" in cfg.explicit else "the checkpoint's"
    tokenizer_from = "given" if "tokenizer_model" in cfg.explicit else "the checkpoint's"
    return f"data {data} ({data_from}, --split {d.split}), tokenizer {tokenizer} ({tokenizer_from})"


def _check_prefixes(data_path: list[str], load: str | None) -> None:
    for _, prefix in parse_data_path(data_path):
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ConfigError(f"--load {load}: the checkpoint's data {' and '.join(missing)} no longer exists; "
                              f"pass --data-path with the token files to use.")


def _same(a: str | None, b: str | None) -> bool:
    return a == b or (a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b))


def _value(value: Any) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)
