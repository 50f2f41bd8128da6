"""What ``--input`` names, read as one Arrow dataset: text, JSONL, parquet or ``save_to_disk`` folders.

An input is a file, a glob, a folder of parquet files or a folder written by ``datasets``'
``save_to_disk`` (it holds ``dataset_info.json`` / ``state.json``, or ``dataset_dict.json`` for
several splits). All inputs must be of one kind; their documents keep the order given (a glob and a
folder in sorted order), so the same texts make the same token files whatever the format.
"""

from __future__ import annotations

import glob
import os
from typing import Sequence

from ..optional import require

_JSON_EXTS = (".json", ".jsonl", ".ndjson")
_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _kind(path: str) -> str:
    if os.path.isdir(path):
        return "disk"
    lower = path.lower()
    return "parquet" if lower.endswith(".parquet") else "json" if lower.endswith(_JSON_EXTS) else "text"


def _expand(path: str) -> list[str]:
    """One --input item as the files or save_to_disk folders it stands for."""
    if not os.path.exists(path):
        matches = sorted(glob.glob(path)) if glob.has_magic(path) else []
        if not matches:
            raise ValueError(f"input file {path!r} does not exist; check --input")
        return [p for match in matches for p in _expand(match)]
    if not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, m)) for m in _DISK_MARKERS):
        return [path]
    parquet = sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True))
    if not parquet:
        held = ", ".join(sorted(os.listdir(path))[:8]) or "nothing"
        raise ValueError(f"--input folder {path!r} holds no .parquet files and is not a save_to_disk dataset "
                         f"(no {' / '.join(_DISK_MARKERS)}; it holds {held}); pass files, a parquet folder or a glob")
    return parquet


def resolve_inputs(inputs: Sequence[str]) -> tuple[str, list[str]]:
    """(kind, paths): kind is text, json, parquet or disk, the same for every input."""
    if not inputs:
        raise ValueError("no input files; pass at least one with --input")
    paths = [p for item in inputs for p in _expand(item)]
    kinds = {_kind(p) for p in paths}
    if len(kinds) > 1:
        raise ValueError(f"--input mixes {' and '.join(sorted(kinds))} inputs; preprocess them separately")
    kind = kinds.pop()
    if kind != "disk" and all(os.path.getsize(p) == 0 for p in paths):
        raise ValueError(f"input {', '.join(inputs)} is empty; nothing to preprocess (check --input)")
    return kind, paths


def _one_dataset(loaded: list, paths: list[str]):  # -> datasets.Dataset
    """Datasets read from ``paths`` as one; a saved DatasetDict gives its only split, or 'train'."""
    import datasets

    parts = []
    for path, part in zip(paths, loaded):
        if isinstance(part, datasets.DatasetDict):
            if len(part) != 1 and "train" not in part:
                raise ValueError(f"--input {path!r} holds splits {sorted(part)} and none is 'train'; pass the "
                                 "folder of one split")
            part = part["train"] if "train" in part else next(iter(part.values()))
        parts.append(part)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _check_column(ds, key: str, inputs: Sequence[str]) -> None:  # ds: datasets.Dataset
    shown = ", ".join(inputs)
    if key not in ds.column_names:
        raise ValueError(f"key {key!r} not found in {shown} (keys: {ds.column_names}); set --json-keys")
    missing = ds.data.column(key).null_count
    if missing:
        raise ValueError(f"{missing} records in {shown} lack key {key!r}; fix the input or --json-keys")


def load_inputs(inputs: Sequence[str], key: str, cache_dir: str):  # -> (datasets.Dataset, str)
    """The documents of ``inputs`` as one dataset and the column that holds their text."""
    require("datasets", "tools/preprocess_data.py (reading --input)")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    kind, paths = resolve_inputs(inputs)
    try:
        loaded = ([datasets.load_from_disk(p) for p in paths] if kind == "disk" else
                  [datasets.load_dataset(kind, data_files=paths, split="train", cache_dir=cache_dir)])
    except Exception as exc:  # datasets and pyarrow wrap parser errors in many types
        raise ValueError(f"could not read --input {', '.join(inputs)} as {kind}: {exc}") from None
    ds = _one_dataset(loaded, paths if kind == "disk" else [", ".join(paths)])
    if kind == "text":
        key = "text"
        ds = ds.filter(lambda b: [bool(t.strip()) for t in b["text"]], batched=True)
    else:
        _check_column(ds, key, inputs)
    if len(ds) == 0:
        raise ValueError(f"input {', '.join(inputs)} has no documents; nothing to preprocess")
    return ds, key
