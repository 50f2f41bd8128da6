"""`make train` starts from scratch, ends with a validation loss and saves the checkpoint docs/generation.md
samples from.

The recipe is the Makefile's own (``make -n train``), run in a scratch folder that links the repository's
files, on 2 ranks and for 4 steps instead of 120 (the flags appended last win); then the first generate
command of docs/generation.md runs there, as pasted.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

from tests.helpers.launch import ROOT
from tests.helpers.shell import fresh_env, logical_lines

STAMP = ".venv/.megazero-installed"


def _recipe() -> list[str]:
    """The commands `make train` runs (the venv taken as built: `-o` keeps make from reinstalling it)."""
    out = subprocess.run(["make", "-s", "-n", "-o", STAMP, "train", "NPROC=2"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return logical_lines(out)


def _first_generate_command() -> str:
    with open(os.path.join(ROOT, "docs", "generation.md"), encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    return next(c for block in blocks for c in logical_lines(block) if "tools/generate.py" in c)


def test_make_train_evaluates_saves_and_docs_generate_from_it(tmp_path) -> None:
    recipe = _recipe()
    train = next(c for c in recipe if "pretrain_gpt.py" in c)
    assert recipe.index("rm -rf runs/tiny") < recipe.index(train), recipe
    for name in ("pretrain_gpt.py", "configs", "megazero", "tools", ".venv"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    stale = tmp_path / "runs" / "tiny" / "checkpoints" / "iter_0000099"  # an earlier run's: removed, not resumed
    stale.mkdir(parents=True)
    (stale.parent / "latest").write_text("iter_0000099\n")
    generate = _first_generate_command()
    script = [c for c in recipe if c != train] + [train + " --train-iters 4 --eval-iters 1", generate]
    done = subprocess.run(["bash", "-e", "-c", "\n".join(script)], cwd=tmp_path, env=fresh_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    save = re.search(r"--save (\S+)", train).group(1)
    assert f"--load {save} " in generate + " "
    assert [n for n in sorted(os.listdir(tmp_path / save)) if n.startswith("iter_")] == ["iter_0000004"]
    assert (tmp_path / save / "latest").read_text().strip() == "iter_0000004"
    metrics = re.search(r"--metrics-file (\S+)", train).group(1)
    records = [json.loads(line) for line in open(tmp_path / metrics).read().splitlines()]
    evaluated = [r["iteration"] for r in records if r.get("event") == "eval"]
    assert evaluated and evaluated[-1] == 4, evaluated
    assert "validation loss" in done.stdout and "Return the" in done.stdout, done.stdout[-2000:]
