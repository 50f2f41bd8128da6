"""Check a checkpoint's metadata.json before anything is loaded from it.

Every rank reads the metadata before any collective (``storage.read_metadata``), so a
damaged or edited file fails on every rank with the same one line, naming the file:
a missing key or a value of the wrong type, a scalar out of range (a negative step,
a loss scale <= 0, a NaN), or an index whose pieces do not cover every tensor exactly
once - a model tensor over its files' regions, an optimizer tensor's saved regions over
its full shape and each region's flat range over the shards that hold pieces of it.
A gap would load as zeros, an overlap as whichever piece is read last; neither may
load silently.
"""
from __future__ import annotations

import math
import os
from typing import Any

from .slices import Region, cover_problem, tp_region, volume

STORED_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})  # torch's names, as the index records them


class Bad(ValueError):
    """One problem in the metadata; ``check`` adds the file's path."""


def _int(value: Any, what: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Bad(f"{what} is {value!r}, not an integer")
    if value < low or (high is not None and value > high):
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise Bad(f"{what} is {value}, it must be {span}")
    return value


def _get(obj: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise Bad(f"{what} is missing")
    if not isinstance(obj[key], kind):
        raise Bad(f"{what} is {obj[key]!r}, not a {getattr(kind, '__name__', kind)}")
    return obj[key]


def _file_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
        raise Bad(f"{what} names {name!r}, not a file inside the checkpoint folder")


def _region(value: Any, ndim: int, what: str) -> Region:
    if not isinstance(value, list) or len(value) != ndim or not all(
            isinstance(r, list) and len(r) == 2 for r in value):
        raise Bad(f"{what} is {value!r}, not {ndim} [start, stop] pairs")
    region = [(_int(lo, what), _int(hi, what)) for lo, hi in value]
    if any(lo >= hi for lo, hi in region):
        raise Bad(f"{what} {value} is empty or reversed")
    return region


def _model(meta: dict[str, Any]) -> dict[str, Any]:
    """Each tensor's entry is well formed and its (tp, pp) files cover it exactly once."""
    model = _get(meta, "model", dict, "'model'")
    if not model:
        raise Bad("'model' lists no tensors")
    for name, entry in model.items():
        what = f"model tensor {name!r}"
        shape = _get(entry, "shape", list, f"{what} 'shape'")
        for n in shape:
            _int(n, f"{what} shape", low=1)
        if "split_dim" not in entry:
            raise Bad(f"{what} 'split_dim' is missing")
        split = entry["split_dim"]
        if split is not None:
            _int(split, f"{what} 'split_dim'", 0, len(shape) - 1)
        if _get(entry, "dtype", str, f"{what} 'dtype'") not in STORED_DTYPES:
            raise Bad(f"{what} has dtype {entry['dtype']!r}, not one of {sorted(STORED_DTYPES)}")
        _get(entry, "padded_rows", bool, f"{what} 'padded_rows'")
        for key in ("expert", "buffer"):  # absent before MoE (and from converters): a dense parameter
            if key in entry:
                _get(entry, key, bool, f"{what} '{key}'")
        files = _get(entry, "files", dict, f"{what} 'files'")
        for fname in files:
            _file_name(fname, f"{what} 'files'")
        pieces = [_region(r, len(shape), f"{what} region in {f!r}") for f, r in files.items()]
        problem = cover_problem(pieces, [(0, n) for n in shape]) if pieces else "no file holds it"
        if problem:
            raise Bad(f"{what} (shape {shape}): {problem}")
    return model


SavedPieces = dict[tuple[tuple[tuple[int, int], ...], int | None], list[tuple[str, int, int]]]


def saved_pieces(meta: dict[str, Any], name: str) -> SavedPieces:
    """The saved optimizer state of model tensor ``name``: (region, copy) -> its [(file, lo, hi)] pieces.

    A region is the part of the full tensor a flat range indexes into: the file's recorded ``regions``
    entry (an expert shard), else the TP shard of the file's ``tp_rank``. ``copy`` tells replicas apart:
    a dense tensor's TP rank (each TP rank saved its own copy of a replicated one); None for an expert
    tensor, whose region alone names the rank that owns it.
    """
    entry, tp = meta["model"][name], meta["layout"]["tp"]
    out: SavedPieces = {}
    for fname, info in meta["optimizer"]["files"].items():
        rng = info["ranges"].get(name)
        if rng is None:
            continue
        region = info.get("regions", {}).get(name) or tp_region(entry["shape"], entry["split_dim"],
                                                                 info["tp_rank"], tp)
        key = (tuple((lo, hi) for lo, hi in region), None if entry.get("expert") else info["tp_rank"])
        out.setdefault(key, []).append((fname, rng[0], rng[1]))
    return out


def _optimizer_entries(files: dict[str, Any], model: dict[str, Any], tp: int) -> None:
    """Each optimizer file's entry is well formed: its TP rank, and a range (and maybe a region) per tensor."""
    for fname, info in files.items():
        _file_name(fname, "'optimizer.files'")
        _int(_get(info, "tp_rank", int, f"optimizer file {fname!r} 'tp_rank'"),
             f"optimizer file {fname!r} 'tp_rank'", 0, tp - 1)
        regions = info.get("regions", {})
        if not isinstance(regions, dict):
            raise Bad(f"optimizer file {fname!r} 'regions' is {regions!r}, not a dict")
        for name, rng in _get(info, "ranges", dict, f"optimizer file {fname!r} 'ranges'").items():
            if name not in model:
                raise Bad(f"optimizer file {fname!r} holds state for {name!r}, which is not a model tensor")
            _region([rng], 1, f"range of {name!r} in {fname!r}")
            if name in regions:
                _region(regions[name], len(model[name]["shape"]), f"region of {name!r} in {fname!r}")


def _optimizer_files(meta: dict[str, Any], model: dict[str, Any], tp: int) -> None:
    """Every tensor's master weights and moments: its saved regions tile the full tensor, and the saved
    pieces of each region tile its flat range."""
    optimizer = _get(meta, "optimizer", dict, "'optimizer'")
    files = _get(optimizer, "files", dict, "'optimizer.files'")
    if not files:  # a converted checkpoint: no optimizer state (nor step, nor RNG files), Adam starts fresh
        if _get(optimizer, "scalars", dict, "'optimizer.scalars'") or meta.get("rng_files"):
            raise Bad("'optimizer.files' is empty, but the checkpoint was saved by training (it has optimizer "
                      "scalars or RNG files): its optimizer state would load as fresh")
        return
    _optimizer_entries(files, model, tp)
    for name, entry in model.items():
        if entry.get("buffer"):
            continue  # a buffer (the router's expert bias) has no optimizer state
        groups = saved_pieces(meta, name)
        full = [(0, n) for n in entry["shape"]]
        problem = cover_problem([list(region) for region, _ in groups], full) if groups else \
            "no optimizer file holds it"
        if problem:
            raise Bad(f"optimizer state of {name!r} (shape {entry['shape']}): {problem}")
        for (region, copy), pieces in groups.items():
            numel = volume(list(region))
            problem = cover_problem([[(lo, hi)] for _, lo, hi in pieces], [(0, numel)])
            if problem:
                shard = f"TP rank {copy} of {tp}" if copy is not None else f"experts region {[list(r) for r in region]}"
                raise Bad(f"optimizer state of {name!r} ({shard}, {numel} elements): {problem}")


def _scalars(meta: dict[str, Any]) -> None:
    scalars = _get(meta["optimizer"], "scalars", dict, "'optimizer.scalars'")
    if "step" in scalars:
        _int(scalars["step"], "'optimizer.scalars.step'")
    scaler = scalars.get("scaler")
    if scaler is None:
        return
    scale = _get(scaler, "scale", (int, float), "'optimizer.scalars.scaler.scale'")
    if isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
        raise Bad(f"the loss scale is {scale!r}; it must be a finite number > 0")
    _int(_get(scaler, "clean_steps", int, "'optimizer.scalars.scaler.clean_steps'"),
         "'optimizer.scalars.scaler.clean_steps'")


def check(meta: Any, path: str) -> None:
    """Raise one ValueError naming ``path`` unless the metadata is complete, in range and covers every tensor."""
    try:
        if not isinstance(meta, dict):
            raise Bad(f"it holds a {type(meta).__name__}, not a JSON object")
        _int(_get(meta, "iteration", int, "'iteration'"), "'iteration'")
        _int(_get(meta, "consumed_samples", int, "'consumed_samples'"), "'consumed_samples'")
        _get(meta, "config", dict, "'config'")
        layout = _get(meta, "layout", dict, "'layout'")
        for key in ("tp", "pp", "dp", "virtual_stages"):
            _int(_get(layout, key, int, f"'layout.{key}'"), f"'layout.{key}'", low=1)
        if "cp" in layout:  # absent before context parallelism (cp 1)
            _int(_get(layout, "cp", int, "'layout.cp'"), "'layout.cp'", low=1)
        _int(_get(layout, "zero", int, "'layout.zero'"), "'layout.zero'", 0, 3)
        if "rng_files" in meta:
            _get(meta, "rng_files", bool, "'rng_files'")
        model = _model(meta)
        _optimizer_files(meta, model, layout["tp"])
        _scalars(meta)
    except Bad as err:
        raise ValueError(f"checkpoint metadata {path!r}: {err}; the checkpoint is damaged or was edited - "
                         f"load an earlier checkpoint.") from None
