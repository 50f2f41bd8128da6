"""docs/deepseek_planner.md's planner blocks are the planner's current output.

The page's blocks sit between ``<!-- plan:NAME begin/end -->`` markers, as the 7B pages' do, and are pasted by
``python -m tests.memory.test_deepseek_planner_doc`` (this module run as a script). The whole search over 1024
GPUs plans about 2000 layouts (40+ CPU-seconds), so the test re-runs the cheap blocks whole (the chosen layout's
stage plan, and the tp 1 search) and, for the search table, checks its best row against the search held at that
row's tp, cp and ep (the best of a subset holding the best is the best): a changed formula fails here.
"""
from __future__ import annotations

import os
import shlex
import sys

from tests.helpers.tool_module import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "deepseek_planner.md")
PRESET = "--config configs/deepseek-v3.yaml"
CLUSTER = "--gpus 1024 --gpu-memory 80 --gpus-per-node 8"
BLOCKS = {  # name -> the plan_memory.py flags the block runs
    "deepseek-search": f"{PRESET} --cp 1 {CLUSTER} --top 12",
    "deepseek-best": f"{PRESET} --tp 8 --cp 1 --pp 1 --dp 128 --ep 256 --etp 1 --zero 1 --micro-batch-size 1 "
                     f"--recompute none --sequence-parallel",
    "deepseek-tp1": f"{PRESET} --cp 1 --tp 1 {CLUSTER} --top 3",
}
HELD_BEST = f"{PRESET} --tp 8 --cp 1 --ep 256 {CLUSTER} --top 1"  # the search block's best row, recomputed


def block(tool, flags: str) -> str:
    """The fenced block: the command, then its output."""
    _, text = tool.report(shlex.split(flags))
    return f"```\n.venv/bin/python tools/plan_memory.py {flags}\n{text}\n```"


def best_row(text: str) -> str:
    (row,) = [line for line in text.splitlines() if line.startswith("*")]
    return row


def test_cheap_blocks_are_current_and_the_search_best_row_too():
    tool = load_tool("plan_memory")
    committed = open(DOC, encoding="utf-8").read()
    cheap = {name: block(tool, flags) for name, flags in BLOCKS.items() if name != "deepseek-search"}
    fresh = tool.replace_blocks(committed, cheap, "docs/deepseek_planner.md")
    assert fresh == committed, "docs/deepseek_planner.md drifted; run python -m tests.memory.test_deepseek_planner_doc"
    _, held = tool.report(shlex.split(HELD_BEST))
    search = committed.split("<!-- plan:deepseek-search begin -->")[1].split("<!-- plan:deepseek-search end -->")[0]
    assert best_row(held) == best_row(search)


def write() -> None:
    """Regenerate every block of the page (the whole search included)."""
    tool = load_tool("plan_memory")
    text = open(DOC, encoding="utf-8").read()
    text = tool.replace_blocks(text, {name: block(tool, flags) for name, flags in BLOCKS.items()}, DOC)
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(write())
