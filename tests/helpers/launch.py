"""Run a script as N real ranks (what torchrun does, minus its agent) and collect their output.

Each rank is its own process with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set, so
the script joins a real gloo world exactly as under torchrun; every rank's
exit code and output are returned, so tests can check each one. By default a
rank is a child of the test forkserver with torch and megazero already imported
(``forked_ranks.py``); ``fresh=True`` starts a new interpreter (``Popen``), for
tests whose subject is the process itself (signals, restarts, process groups).
``run_python`` is ``subprocess.run([sys.executable, *argv])`` the same way, for one tool run.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from megazero.parallel.state import free_port
from tests.helpers.forked_ranks import MODULE, run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The flags that choose a run's data; a launch that gives none of them trains on the small corpus below.
DATA_FLAGS = ("--data-path", "--tokenizer-model", "--tokenizer-type", "--load", "--finetune")
TEST_VOCAB = 512


@functools.cache
def small_corpus_args() -> list[str]:
    """``--data-path``/``--tokenizer-model`` of the default corpus's documents tokenized at vocabulary 512.

    The default corpus's 8000-token head is ~60% of a tiny model's CPU step (bench/RESULTS_tests.md), so
    launches whose subject is not the corpus train on this copy; built once per machine (cached and published
    atomically beside the default one, so two pytest workers may both ask for it)."""
    from megazero.data.corpus import default_corpus

    paths = default_corpus(vocab_size=TEST_VOCAB, log=lambda _: None)
    return ["--data-path", paths.data_prefix, "--tokenizer-model", paths.tokenizer_model]


def with_small_corpus(script: str, args: list[str], default_corpus: bool) -> list[str]:
    """``args`` for ``pretrain_gpt.py`` with the small corpus's flags first, unless the run chooses its data itself
    (a flag of ``DATA_FLAGS``) or its subject is the default corpus (``default_corpus=True``)."""
    if default_corpus or os.path.basename(script) != "pretrain_gpt.py":
        return args
    if any(a.split("=")[0] in DATA_FLAGS for a in args):
        return args
    return [*small_corpus_args(), *args]


@dataclass
class RankResult:
    returncode: int
    stdout: str
    stderr: str


def launch(script: str, args: list[str], nproc: int, timeout: float = 300,
           env: dict[str, str] | None = None, fresh: bool = False, default_corpus: bool = False) -> list[RankResult]:
    """Each rank's exit code and output. ``fresh=True`` (a real interpreter per rank) is for the files
    ``tests/test_repo_rules.py`` lists: those whose subject is the process itself. ``pretrain_gpt.py`` runs that
    name no data train on the small-vocabulary corpus unless ``default_corpus`` (``with_small_corpus``)."""
    args = with_small_corpus(script, args, default_corpus)
    port = str(free_port())
    rank_envs = [{**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                  "PYTHONPATH": ROOT, **(env or {})} for rank in range(nproc)]
    path = os.path.join(ROOT, script)
    if not fresh:
        return [RankResult(*r) for r in run_forked(path, rank_envs, args, ROOT, timeout)]
    procs = []
    for rank_env in rank_envs:
        procs.append(subprocess.Popen([sys.executable, path, *args], env=rank_env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(RankResult(p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def run_python(argv: list[str], *, cwd: str = ROOT, env: dict[str, str] | None = None, timeout: float = 300,
               input: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`` as a forked child of
    the test forkserver: ``argv`` is ``["tools/x.py", *args]`` (relative to ``cwd``) or ``["-m", "pkg.mod",
    *args]``. ``env`` replaces the environment (None: a copy of this one); ``input`` is fed on stdin (else
    /dev/null). For runs whose subject is the tool's exit code and output; a fresh interpreter
    (``subprocess.run``) stays only where ``tests/test_repo_rules.py`` lists why."""
    if argv[0] == "-m":
        script, args = MODULE + argv[1], argv[2:]
    else:
        script, args = os.path.join(cwd, argv[0]), argv[1:]
    with tempfile.TemporaryDirectory(prefix="stdin-") as tmp:
        stdin = os.devnull
        if input is not None:
            stdin = os.path.join(tmp, "stdin")
            with open(stdin, "w") as f:
                f.write(input)
        started = time.monotonic()
        [(code, out, err)] = run_forked(script, [dict(os.environ if env is None else env)], args, cwd, timeout,
                                        stdin=stdin)
    if code == -9 and time.monotonic() - started >= timeout:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out, err)
    return subprocess.CompletedProcess([sys.executable, *argv], code, out, err)


def metrics_records(metrics, args: list[str], nproc: int, timeout: float = 300,
                    default_corpus: bool = False, fresh: bool = False) -> list[dict]:
    """Run pretrain_gpt.py on ``nproc`` ranks writing ``metrics`` (a path); every rank must exit 0.
    Returns every record of the metrics file, start-up events included. ``fresh``: as for ``launch``."""
    import json

    results = launch("pretrain_gpt.py", [*args, "--metrics-file", str(metrics)], nproc, timeout=timeout,
                     default_corpus=default_corpus, fresh=fresh)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"{metrics} rank {rank} failed:\n{r.stderr[-3000:]}"
    return [json.loads(line) for line in open(metrics).read().splitlines()]


def train_records(metrics, args: list[str], nproc: int, default_corpus: bool = False,
                  fresh: bool = False) -> list[dict]:
    """As ``metrics_records``, the per-iteration records only (start-up events left out)."""
    return [r for r in metrics_records(metrics, args, nproc, default_corpus=default_corpus, fresh=fresh)
            if "event" not in r]
