"""The flag set of pretrain_gpt.py is frozen: every flag, its aliases and its default, as tests/flags.txt lists them.

A flag added, removed, renamed or given a new default changes what users' commands and presets mean, so it is
a decision made in the same commit as tests/flags.txt (torchtitan freezes its job config the same way). To
accept a change: ``.venv/bin/python tests/test_flag_set.py > tests/flags.txt`` and review the diff.
"""
from __future__ import annotations

import argparse
import os
import sys

FROZEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flags.txt")


def flag_lines() -> list[str]:
    """One line per option of pretrain_gpt.py: its spellings, then ``=`` and its default."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pretrain_gpt
    from megazero.arguments import build_parser, parse_config

    parser = build_parser(extra=pretrain_gpt.DRY_RUN_FLAGS)
    defaults = parse_config([])[0].to_flat()  # the parser suppresses defaults (to tell a given flag); the config's
    return sorted(f"{' '.join(a.option_strings)} = {defaults.get(a.dest, a.default)!r}" for a in parser._actions
                  if a.option_strings and not isinstance(a, argparse._HelpAction))


def test_the_flag_set_is_the_frozen_one():
    with open(FROZEN, encoding="utf-8") as fh:
        frozen = fh.read().splitlines()
    now = flag_lines()
    added, removed = sorted(set(now) - set(frozen)), sorted(set(frozen) - set(now))
    assert not added and not removed, ("the flag set changed; if meant, regenerate tests/flags.txt (see the module "
                                       f"docstring).\nnew or changed: {added}\ngone or changed: {removed}")


if __name__ == "__main__":
    print("\n".join(flag_lines()))
