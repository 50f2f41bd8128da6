"""What the doc-command tests share: a doc block's logical lines, and a new login shell's environment."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def logical_lines(body: str) -> list[str]:
    """``body``'s lines with backslash continuations joined, comments and blank lines dropped."""
    lines = []
    for line in re.sub(r"\\\n\s*", " ", body).splitlines():
        line = re.sub(r"\s+#.*$|^#.*$", "", line).strip()
        if line:
            lines.append(" ".join(line.split()))
    return lines


def fresh_env() -> dict[str, str]:
    """A new login shell's environment: no venv on PATH (nor VIRTUAL_ENV), no PYTHONPATH (conftest sets one)."""
    venv_bin = os.path.realpath(os.path.join(ROOT, ".venv", "bin"))
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep)
            if p and os.path.realpath(p) != venv_bin and not os.path.exists(os.path.join(p, "activate"))]
    keep = {k: os.environ[k] for k in ("HOME", "USER", "LANG", "LC_ALL", "TMPDIR") if k in os.environ}
    return {**keep, "PATH": os.pathsep.join(path) or "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
