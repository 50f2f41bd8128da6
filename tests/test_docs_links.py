"""The README is a short page for users; the guides it links under docs/ exist.

Every relative link in README.md and docs/*.md must name an existing file (and, with a
``#fragment``, a heading there), every guide in docs/ must be reachable from the README, the
README stays short and starts with the two commands that work on a fresh machine, and no user
page names a machine-specific path.
"""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MAX_README_LINES = 300


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where a link is a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`\n]*`", "", text)


def _links(path: str) -> list[str]:
    return [t for t in LINK.findall(_prose(_read(path))) if not re.match(r"^[a-z]+:", t)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+\s+(.*)$", _prose(_read(path)), flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page: str) -> None:
    broken = []
    for target in _links(page):
        file_part, _, fragment = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
        if not os.path.exists(dest):
            broken.append(f"{target} (no file {os.path.relpath(dest, ROOT)})")
        elif fragment and (not dest.endswith(".md") or fragment not in _anchors(dest)):
            broken.append(f"{target} (no heading #{fragment})")
    assert not broken, f"{os.path.relpath(page, ROOT)}: broken links: {broken}"


def test_every_guide_is_linked_from_the_readme() -> None:
    linked = {os.path.normpath(os.path.join(ROOT, t.partition("#")[0])) for t in _links(README)}
    orphans = [os.path.relpath(p, ROOT) for p in PAGES[1:] if os.path.normpath(p) not in linked]
    assert PAGES[1:], "docs/ holds no guide"
    assert not orphans, f"guides the README does not link: {orphans}"


def test_readme_is_short_and_starts_with_the_fresh_machine_commands() -> None:
    text = _read(README)
    assert len(text.splitlines()) < MAX_README_LINES, f"README.md has {len(text.splitlines())} lines"
    first_block = re.search(r"^```[a-z]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    assert first_block, "README.md has no code block"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands[:2] == ["make train", "make test"], commands


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_machine_specific_paths(page: str) -> None:
    hits = re.findall(r"(?<![\w.~])/(?:work|home|Users|root)/\S*", _read(page))
    assert not hits, f"{os.path.relpath(page, ROOT)} names machine paths: {hits}"
