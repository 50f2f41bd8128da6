"""The session cache of serial references: one run per distinct call, each caller its own copy, bitwise the
run the caller would have made; any differing config field or thread count is another run."""
from __future__ import annotations

import dataclasses

import torch

from tests.helpers import cp_runs, session_cache
from tests.helpers.session_cache import cached

CALLS: list[tuple] = []


def _counted(*args, **kwargs) -> dict:
    CALLS.append((args, kwargs))
    return {"args": list(args), "weights": torch.arange(3.0)}


def test_one_run_per_distinct_call_and_a_copy_for_each_caller():
    CALLS.clear()
    first = cached(_counted, 1, scale=2.0)
    first["weights"].add_(100)  # a caller that edits its reference...
    first["args"].append("edited")
    again = cached(_counted, 1, scale=2.0)
    assert len(CALLS) == 1, CALLS
    assert again["args"] == [1] and torch.equal(again["weights"], torch.arange(3.0))  # ...changes no other's
    cached(_counted, 1, scale=3.0)
    cached(_counted, 2, scale=2.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        cached(_counted, 1, scale=2.0)  # the thread count changes a run's sums: part of the key
    finally:
        torch.set_num_threads(threads)
    assert len(CALLS) == 4, CALLS


def test_a_cached_serial_reference_is_bitwise_a_fresh_run_and_keyed_by_every_field():
    cfg = cp_runs.make_cfg("gpt2", cp=2, iters=2)
    before = len(session_cache._RESULTS)
    ref = cp_runs.serial_reference(cfg)
    # the same serial training from another layout (cp 4, ZeRO 3): the cache answers, no second run
    assert _bitwise(cp_runs.serial_reference(cp_runs.make_cfg("gpt2", cp=4, zero=3, iters=2)), ref)
    assert len(session_cache._RESULTS) == before + 1
    fresh = cp_runs._serial_run(cp_runs.serial_config(cfg))
    assert _bitwise(ref, fresh)
    other = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seed=8))
    assert not _bitwise(cp_runs.serial_reference(other), ref)
    assert len(session_cache._RESULTS) == before + 2


def _bitwise(a: dict, b: dict) -> bool:
    same_records = [(r["loss"], r["grad_norm"]) for r in a["records"]] == [(r["loss"], r["grad_norm"])
                                                                           for r in b["records"]]
    return same_records and a["params"].keys() == b["params"].keys() and all(
        torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
