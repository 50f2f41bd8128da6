"""One run per distinct serial reference for the whole pytest session.

Parity tests compare many parallel runs with the same one-process run: cp 2, cp 4, cp2 x pp2 and cp2 x dp2 at
any ZeRO stage all reduce to one serial config, and several tests and files ask for it again. ``cached(fn,
*args)`` runs ``fn`` once per distinct call and hands every caller its own deep copy (a caller that edits its
result cannot change another's reference). Two calls are the same when ``fn`` is the same object and the
arguments compare equal (``==``: every field of a Config is in the key) under the same torch thread count and
default dtype, the process state a run's numbers depend on. Only for pure functions: the same arguments give the
same numbers (a serial run seeds itself from its config), so a cached reference is bitwise the one the caller
would have computed.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

_RESULTS: list[tuple[tuple, Any]] = []  # (key, result); a list because Configs compare but do not hash


def _key(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    return fn, args, kwargs, torch.get_num_threads(), torch.get_default_dtype()


def cached(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, computed once per session for equal arguments; a fresh copy each call."""
    key = _key(fn, args, kwargs)
    for seen, result in _RESULTS:
        if seen[0] is fn and seen[1:] == key[1:]:
            return copy.deepcopy(result)
    result = fn(*args, **kwargs)
    _RESULTS.append((copy.deepcopy(key), copy.deepcopy(result)))
    return copy.deepcopy(result)
