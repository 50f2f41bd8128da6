"""The planner tables in docs/memory_planner.md and docs/planner_7b.md are the planner's current output.

They are pasted by ``python tools/plan_memory.py --write-docs`` between
``<!-- plan:NAME begin/end -->`` markers; this re-runs the planner and fails
when the committed text differs (a changed formula, a stale hand edit). The blocks ask the
layout search the same question more than once (the 7B search at 64 GPUs three times: two tables and
the best layout's flags); the test answers a repeated question from the first answer, which is the
same (the search is a pure function of the config and hardware, both compared whole by their repr).
"""
from __future__ import annotations

import difflib
import inspect
import os
from types import ModuleType

import pytest

from tests.helpers.tool_module import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _searching_once(tool: ModuleType) -> ModuleType:
    """``tool`` whose ``search_layouts`` computes each distinct (config, hardware, options) once."""
    search, answers = tool.search_layouts, {}
    signature = inspect.signature(search)

    def remembered(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = repr(bound.arguments)
        if key not in answers:
            answers[key] = search(*args, **kwargs)
        return answers[key]

    tool.search_layouts = remembered
    return tool


def test_docs_tables_match_planner():
    tool, stale = _searching_once(load_tool("plan_memory")), []
    for rel, blocks in tool.doc_blocks().items():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            committed = f.read()
        fresh = tool.replace_blocks(committed, blocks, rel)
        if fresh != committed:
            diff = difflib.unified_diff(committed.splitlines(), fresh.splitlines(), rel, "planner", lineterm="", n=1)
            stale.append("\n".join(list(diff)[:40]))
    assert not stale, "planner tables drifted; run `python tools/plan_memory.py --write-docs`:\n" + "\n".join(stale)


def test_drift_is_detected():
    """A stale number inside a block is replaced; text outside the markers is kept; no markers is an error."""
    tool = load_tool("plan_memory")
    text = "intro 14.6\n<!-- plan:x begin -->\n528 feasible\n<!-- plan:x end -->\ntail\n"
    assert tool.replace_blocks(text, {"x": "550 feasible"}, "T.md") == \
        "intro 14.6\n<!-- plan:x begin -->\n550 feasible\n<!-- plan:x end -->\ntail\n"
    with pytest.raises(ValueError, match="plan:y begin"):
        tool.replace_blocks(text, {"y": "body"}, "T.md")
