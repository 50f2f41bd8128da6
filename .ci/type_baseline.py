"""Type-check megazero/ with mypy against a committed baseline that may only shrink.

    .venv/bin/python .ci/type_baseline.py            # fail on any error not in the baseline
    .venv/bin/python .ci/type_baseline.py --update   # rewrite the baseline (only ever to remove lines)

An error is keyed by its file, message and code, without the line number, so an edit elsewhere in a file
does not move it; the baseline holds one line per key with its count. A new key, or a count above the
baseline's, fails with the errors themselves. A fixed error leaves a stale line: the check says so and
asks for --update (it does not fail on it), so the baseline shrinks with the code.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(ROOT, ".ci", "mypy-baseline.txt")
ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<message>.*)$")


def mypy_errors() -> list[tuple[str, str, str]]:
    """(file, line, message) of every mypy error on megazero/ (settings in pyproject.toml)."""
    result = subprocess.run([sys.executable, "-m", "mypy", "megazero"], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    if result.returncode not in (0, 1):  # 2: mypy itself failed (a crash, a bad setting)
        sys.exit(f"mypy failed to run:\n{result.stdout}{result.stderr}")
    return [(m["file"], m["line"], m["message"]) for m in map(ERROR.match, result.stdout.splitlines()) if m]


def read_baseline() -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    if os.path.exists(BASELINE):
        with open(BASELINE, encoding="utf-8") as fh:
            for row in fh:
                count, _, key = row.rstrip("\n").partition(" ")
                counts[key] = int(count)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline from this tree's errors")
    args = parser.parse_args(argv)
    errors = mypy_errors()
    found = collections.Counter(f"{path}: {message}" for path, _, message in errors)
    baseline = read_baseline()
    if args.update:
        grown = sorted(key for key in found if found[key] > baseline[key])
        if grown and baseline:
            print(f"note: the baseline grows by {len(grown)} key(s); review them:\n  " + "\n  ".join(grown))
        with open(BASELINE, "w", encoding="utf-8") as fh:
            fh.writelines(f"{found[key]} {key}\n" for key in sorted(found))
        print(f"mypy baseline: {sum(found.values())} errors in {len(found)} keys written to {BASELINE}")
        return 0
    new = [f"{path}:{line}: {message}" for path, line, message in errors
           if found[f"{path}: {message}"] > baseline[f"{path}: {message}"]]
    if new:
        print(f"mypy: {len(new)} error(s) beyond the baseline .ci/mypy-baseline.txt (fix them; the baseline only "
              f"shrinks):\n" + "\n".join(new))
        return 1
    stale = sum((baseline - found).values())
    if stale:
        print(f"mypy: {stale} baseline error(s) are fixed; shrink the baseline with "
              f"`.venv/bin/python .ci/type_baseline.py --update` and commit it.")
    print(f"mypy: {sum(found.values())} known errors, none new (baseline .ci/mypy-baseline.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
