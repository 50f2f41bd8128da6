"""Every command in README.md and docs/*.md runs as written, in a fresh shell, on a CPU-only machine.

A command is a logical line (backslash continuations joined) of a ```bash block; in any other
fenced block (a transcript) a line that starts with ``$ `` or a launcher; and inline code that runs
a script (``.py``/``.sh``), a module (``-m bench.run``) or a make target. Each one is classified in
``COMMANDS``: ``RUN`` (run here in a fresh environment - no venv on PATH, no PYTHONPATH, as a new
shell after ``make setup`` - and exit 0 asserted) or the reason it is not run here. A command the
table does not know, or an entry no page holds any more, fails: a new doc command is a decision,
not a silent filter. The planner's generated blocks (between ``<!-- plan:NAME -->`` markers) are run in-process by
tests/memory/test_docs_tables.py, which compares their output too.

Every command names the project's environment itself (``.venv/bin/python``, ``.venv/bin/torchrun``),
so none needs an activated venv; the GPU check's own ``python3`` is the one stated exception. And
``--help`` of every entry point - pretrain_gpt.py, everything in tools/, every script or repository
module (``-m bench.x``) a doc command runs - exits 0 and prints usage (a ``%`` in a help text once
made argparse raise instead).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess

import pytest

from tests.helpers.shell import ROOT, fresh_env, logical_lines

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
RUN = "run"
LAUNCHER = r"(?:\$ |\.venv/bin/|python3? |torchrun |make |bash |[A-Z_]+=\S* )"
BARE = {"python", "python3", "torchrun", "pytest", "pip"}  # on PATH in a fresh shell: not the venv's

_TRAINS = "trains a model (minutes on 2 cores); tests/test_pretrain.py launches pretrain_gpt.py at small sizes"
_BENCH = "a benchmark: minutes, peers from `make bench`; its results are in bench/RESULTS*.md"
_USER_DATA = "reads the user's own corpus; tests/data/test_tokenizer_preprocess.py runs these tools on test data"
_MULTI_NODE = "needs several nodes (node0) or Slurm; tests/parallel/test_two_nodes.py runs two nodes on one machine"
_GPU = "GPU only, by the machine's own python3 (docs/gpu.md says why); `make gpu-check` runs it where a GPU is"
_GENERATE = "reads the checkpoint the training above saves; tests/tools/test_generate.py generates from one"
_GENERATE_MAKE = "reads the checkpoint `make train` saves (minutes); tests/test_make_train.py checks the folder"
_CKPT = "converts a checkpoint a training run wrote; tests/checkpoint/ converts both ways"
_PLOT = "plots the metrics of `make train` (minutes); tests/training/test_tensorboard_plot.py plots two runs' metrics"

COMMANDS: dict[str, str] = {
    # README.md
    "make train": _TRAINS,
    "make test": "the whole suite, which this test is part of",
    "make test-quick": "a part of the suite (the tests that start no process of their own; this one does)",
    "make lint": "CI runs it before the tests (.ci/run)",
    # docs/architecture.md
    ".venv/bin/python tools/compare_step_records.py --help": RUN,
    ".venv/bin/python -m pytest tests/checkpoint -q": "a part of the suite, which this test is part of",
    ".venv/bin/torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/tiny.yaml --tp 2 --pp 2 --zero 2":
        _TRAINS,
    ".venv/bin/python pretrain_gpt.py --config configs/tiny.yaml --train-iters 20": _TRAINS,
    ".venv/bin/python pretrain_gpt.py --config configs/llama-7b.yaml --tp 8 --pp 2 --dp 4 --dry-run "
    "--memory-budget-gb 80": RUN,
    ".venv/bin/torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint node0:29400 "
    "--rdzv-id job42 pretrain_gpt.py --config configs/llama-7b.yaml --tp 8 --pp 2": _MULTI_NODE,
    "mkdir -p runs/llama-1b && sbatch examples/slurm/pretrain_gpt.sbatch": _MULTI_NODE,
    "bash examples/context_parallel/run_8_ranks.sh": _TRAINS + " (8 ranks, resumes at cp 4)",
    ".venv/bin/python tools/convert_checkpoint.py --input runs/ckpt --output hf_model --to hf": _CKPT,
    ".venv/bin/python pretrain_gpt.py --config configs/tiny.yaml --train-iters 20 --eval-interval 10 --save runs/ckpt":
        _TRAINS,
    ".venv/bin/python pretrain_gpt.py --config configs/tiny.yaml --load runs/ckpt --skip-train":
        "evaluates the checkpoint the training above saves; tests/checkpoint/test_finetune.py runs --skip-train",
    ".venv/bin/python pretrain_gpt.py --config configs/tiny.yaml --train-iters 20 --load runs/ckpt --finetune --save "
    "runs/finetuned": _TRAINS + " (from the checkpoint above; tests/checkpoint/test_finetune.py runs --finetune)",
    ".venv/bin/python tools/convert_checkpoint.py --input hf_model --output runs/from_hf --to megazero --tp 2 "
    "--pp 2": _CKPT,
    ".venv/bin/python tools/convert_checkpoint.py --input hf_mixtral --output runs/from_hf --to megazero --ep 2":
        "converts an HF Mixtral folder; tests/checkpoint/test_hf_moe.py converts tiny ones at --ep 2 and back",
    "$ .venv/bin/torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/tiny.yaml --tp 2 --pp 2 --zero 2 "
    "--train-iters 20 --log-timers --eval-interval 20 --save runs/tiny-8 --metrics-file runs/tiny-8/metrics.jsonl":
        _TRAINS,
    ".venv/bin/torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --config configs/tiny.yaml --tp 3 2>&1 | "
    "tail -3": RUN,
    ".venv/bin/python tools/plot_metrics.py runs/tiny/metrics.jsonl runs/tiny-lr3e-3/metrics.jsonl --output "
    "docs/img/tiny_metrics.png": _PLOT,
    ".venv/bin/python tools/plan_memory.py --config configs/llama-7b.yaml --tp 2 --pp 4 --dp 8 --zero 1": RUN,
    ".venv/bin/python tools/plan_memory.py --config configs/llama-7b.yaml --gpus 64 --gpu-memory 80 --top 5": RUN,
    ".venv/bin/python tools/plan_memory.py --config configs/deepseek-v3.yaml --cp 1 --gpus 1024 --gpu-memory 80 "
    "--gpus-per-node 8 --top 12": "the layout search over ~2000 plans (about 40 CPU-seconds); "
                                  "tests/memory/test_deepseek_planner_doc.py re-runs its stage plan and tp 1 search",
    ".venv/bin/torchrun --nnodes 128 --nproc_per_node 8 pretrain_gpt.py --config configs/deepseek-v3.yaml --tp 8 "
    "--ep 256 --etp 1 --zero 1": _MULTI_NODE,
    "make gpu-check": "GPU only: without a GPU it says so and exits 0; tests/cuda/ holds what it runs",
    "make setup": "creates .venv, the environment this test runs in",
    # docs/
    ".venv/bin/python tools/plot_metrics.py runs/tiny/metrics.jsonl --output runs/tiny/metrics.png": _PLOT,
    "OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --config configs/tiny.yaml "
    "--tp 2 --pp 2 --train-iters 40 --save runs/tiny-gen": _TRAINS,
    '.venv/bin/python tools/generate.py --load runs/tiny-gen --prompt "Return the" --max-new-tokens 32': _GENERATE,
    '.venv/bin/python tools/generate.py --load runs/tiny/checkpoints --prompt "Return the" --max-new-tokens 32':
        _GENERATE_MAKE,
    '.venv/bin/python tools/generate.py --load runs/tiny/checkpoints --prompt "Return the" --prompt "If" '
    "--temperature 0.8 --top-k 50 --top-p 0.95 --seed 1 --print-ids": _GENERATE_MAKE,
    ".venv/bin/torchrun --nproc_per_node 8 pretrain_gpt.py --tp 2 --cp 2 --pp 2 --zero 3 --seq-length 2048": _TRAINS,
    ".venv/bin/python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok --vocab-size 32000":
        _USER_DATA,
    ".venv/bin/python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus "
    "--tokenizer-model tok.model --workers 2": _USER_DATA,
    ".venv/bin/torchrun --nproc_per_node 4 pretrain_gpt.py --data-path data/corpus --tokenizer-model tok.model "
    "--tp 2": _USER_DATA,
    ".venv/bin/torchrun --nproc_per_node 4 pretrain_gpt.py --data-path 0.7 data/a 0.3 data/b "
    "--tokenizer-model tok.model": _USER_DATA,
    **dict.fromkeys([
        "mkdir -p /tmp/megazero-hf && .venv/bin/python -c \"import datasets; from megazero.data.corpus import "
        "corpus_documents; ds = datasets.Dataset.from_dict({'text': corpus_documents(max_bytes=200_000)}); "
        "ds.to_json('/tmp/megazero-hf/corpus.jsonl'); ds.to_parquet('/tmp/megazero-hf/corpus.parquet'); "
        "ds.save_to_disk('/tmp/megazero-hf/saved')\"",
        ".venv/bin/python tools/train_tokenizer.py --input /tmp/megazero-hf/corpus.jsonl --model-prefix "
        "/tmp/megazero-hf/tok --vocab-size 2000 --model-type byte-bpe",
        ".venv/bin/python tools/preprocess_data.py --input /tmp/megazero-hf/corpus.jsonl --output-prefix "
        "/tmp/megazero-hf/jsonl/corpus --tokenizer-model /tmp/megazero-hf/tok",
        ".venv/bin/python tools/preprocess_data.py --input '/tmp/megazero-hf/*.parquet' --output-prefix "
        "/tmp/megazero-hf/parquet/corpus --tokenizer-model /tmp/megazero-hf/tok --workers 2",
        ".venv/bin/python tools/preprocess_data.py --input /tmp/megazero-hf/saved --output-prefix "
        "/tmp/megazero-hf/data/corpus --tokenizer-model /tmp/megazero-hf/tok",
        "cmp /tmp/megazero-hf/jsonl/corpus.bin /tmp/megazero-hf/parquet/corpus.bin && cmp "
        "/tmp/megazero-hf/jsonl/corpus.idx /tmp/megazero-hf/data/corpus.idx"],
        "the HF tokenizer walk-through (a minute); tests/data/test_hf_tokenizer.py and "
        "tests/data/test_preprocess_formats.py run its steps at test sizes"),
    "chmod a-w /tmp/megazero-hf/data && .venv/bin/python pretrain_gpt.py --config configs/tiny.yaml --train-iters 20 "
    "--data-path /tmp/megazero-hf/data/corpus --tokenizer-model /tmp/megazero-hf/tok --data-cache-path "
    "/tmp/megazero-hf/index-cache": _TRAINS,
    # docs/data.md and docs/context_parallel.md: packed documents
    ".venv/bin/torchrun --nproc_per_node 4 pretrain_gpt.py --config configs/tiny.yaml --cp 2 --reset-position-ids "
    "--reset-attention-mask --eod-mask-loss": _TRAINS + " (tests/context_parallel/test_cp_documents_training.py "
                                              "trains with the three flags in every layout)",
    ".venv/bin/python tools/plan_memory.py --config configs/llama-7b.yaml --seq-length 32768 --cp 8 --dp 1 "
    "--global-batch-size 8 --reset-attention-mask --plan-document-length 4096": RUN,
    ".venv/bin/torchrun --nproc_per_node 4 pretrain_gpt.py --config configs/tiny.yaml --cp 4 --cp-comm-type a2a+p2p "
    "--cp-a2a-size 2 --reset-position-ids --reset-attention-mask --eod-mask-loss": _TRAINS + " (the hybrid; "
    "tests/context_parallel/test_cp_documents_training.py trains it with the flags)",
    "PYTHON=$PWD/.venv/bin/python srun --ntasks-per-node=1 tools/launch_slurm.sh --nproc-per-node 4 -- "
    "--config configs/tiny.yaml --tp 2 --save D --load D": _MULTI_NODE,
    "OFFLOAD=/path/on/a/fast/local/disk": "a placeholder for the reader's disk, used by the recipe below",
    "OMP_NUM_THREADS=2 .venv/bin/python pretrain_gpt.py --config configs/llama-1.8b-offload.yaml "
    "--offload-path $OFFLOAD --metrics-file runs/offload-1.8b/metrics.jsonl": _TRAINS + " (1.8B from disk)",
    "sed '/offload/d;/eval_/d' configs/llama-1.8b-offload.yaml > base.yaml": "a step of the offload recipe",
    "OMP_NUM_THREADS=2 /usr/bin/time -v .venv/bin/python pretrain_gpt.py --config base.yaml --train-iters 3 "
    "--lr-warmup-iters 0 --num-layers L FLAGS": "a template: L and FLAGS are the reader's",
    ".venv/bin/python tools/plan_memory.py --config configs/llama-7b.yaml --tp 1 --pp 1 --dp 64 --zero 2 "
    "--global-batch-size 1024 --micro-batch-size 1 --recompute full --reduce-every-micro-batch": RUN,
    ".venv/bin/python tools/plan_memory.py --write-docs": "rewrites docs/; tests/memory/test_docs_tables.py checks "
                                                          "the same output without writing",
    # docs/moe.md: the end-to-end run it records
    **dict.fromkeys([
        ".venv/bin/torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/moe-tiny.yaml --tp 2 --ep 2 --pp 2 "
        "--zero 3",
        ".venv/bin/torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/moe-tiny.yaml --tp 2 --ep 2 --pp 2 "
        "--zero 3 --eval-interval 60 --save-interval 60 --save runs/moe-tiny --metrics-file "
        "runs/moe-tiny/metrics.jsonl",
        ".venv/bin/torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/moe-tiny.yaml --tp 2 --ep 2 --pp 2 "
        "--zero 3 --eval-interval 60 --load runs/moe-tiny/iter_0000060 --metrics-file "
        "runs/moe-tiny-resumed/metrics.jsonl",
        ".venv/bin/torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/moe-tiny.yaml --tp 2 --ep 4 --pp 1 "
        "--zero 3 --load runs/moe-tiny --train-iters 160 --lr-decay-iters 120 --eval-interval 40 --save "
        "runs/moe-tiny-ep4 --metrics-file runs/moe-tiny-ep4/metrics.jsonl"],
        _TRAINS + " (docs/moe.md records what they printed; tests/moe/test_moe_training.py and "
        "tests/checkpoint/test_moe_checkpoints.py train, resume and reshard MoE layouts at small sizes)"),
    ".venv/bin/python -c \"import json; f = lambda p: {(r.get('event'), r['iteration']): [r.get(k) for k in ('loss', "
    "'grad_norm', 'val_loss', 'moe_layers')] for r in map(json.loads, open(p)) if (r.get('iteration') or 0) > 60}; "
    "b = f('runs/moe-tiny-resumed/metrics.jsonl'); print(len(b), all(f('runs/moe-tiny/metrics.jsonl')[k] == v for k, "
    "v in b.items()))\"": "reads the metrics of the two docs/moe.md runs above (minutes to make); "
                          "tests/checkpoint/test_moe_checkpoints.py resumes MoE runs bitwise",
    ".venv/bin/python -m bench.bench_zero": _BENCH,
    ".venv/bin/python -m bench.bench_doc_attention": _BENCH,
    ".venv/bin/python -m bench.bench_qk_clip": _BENCH,
    ".venv/bin/python -m bench.bench_cp_peer --repeats 9": _BENCH,
    ".venv/bin/python -m bench.bench_moe --repeats 21": _BENCH,
    ".venv/bin/python -m bench.bench_moe_model --launches 3 --iters 6": _BENCH,
    "OMP_NUM_THREADS=1 .venv/bin/python -m bench.run --repeats 5 --steps 8": _BENCH,
    "make bench": _BENCH,
    ".venv/bin/python -m bench.bench_zero3 --repeats 5": _BENCH,
    ".venv/bin/python -m bench.bench_offload": _BENCH,
    ".venv/bin/python -m bench.bench_offload --model big": _BENCH,
    ".venv/bin/python -m bench.bench_cpu_adam": _BENCH,
    ".venv/bin/python -m bench.bench_pipeline": _BENCH,
    ".venv/bin/python -m bench.bench_data": _BENCH,
    "python3 -m bench.gpu_mfu": _GPU,
    "python3 -m bench.gpu_mfu --ladder": _GPU,
}
OWN_PYTHON = {"python3 -m bench.gpu_mfu", "python3 -m bench.gpu_mfu --ladder"}


def _page_commands(text: str) -> list[str]:
    """The commands of one page (see the module docstring), generated planner blocks left out."""
    text = re.sub(r"<!-- plan:(\S+) begin -->.*?<!-- plan:\1 end -->", "", text, flags=re.DOTALL)
    commands = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        lines = logical_lines(body)
        commands += lines if lang in ("bash", "sh") else [ln for ln in lines if re.match(LAUNCHER, ln)]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if re.match(LAUNCHER, span) and (re.search(r"\S\.(py|sh)\b|\s-m \w", span) or span.startswith("make ")):
            commands.append(" ".join(span.split()))
    return commands


def doc_commands() -> dict[str, list[str]]:
    """Command -> the pages that hold it."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            for command in _page_commands(f.read()):
                found.setdefault(command, []).append(page)
    return found


def programs(command: str) -> list[str]:
    """The program each simple command of ``command`` starts (after a prompt, NAME=value words, time -v)."""
    out = []
    for part in re.split(r"&&|\|\||;|\|", command.removeprefix("$ ")):
        words = part.split()
        while words and re.match(r"[A-Za-z_]\w*=", words[0]):
            words.pop(0)
        words = words[2:] if words[:2] == ["/usr/bin/time", "-v"] else words
        out += words[:1]
    return out


def run_in_fresh_shell(commands: list[str], tmp_path, limit_s: int = 120,
                       first_limit_s: int | None = None) -> list[tuple[int, str]]:
    """(exit code, output) of each command, run one after another from the repository root by one bash
    script; a command past ``limit_s`` (the first: ``first_limit_s``, if given) is killed (exit 124: one that
    ignores --help and starts working)."""
    limits = [first_limit_s or limit_s] + [limit_s] * (len(commands) - 1)
    script = [f"cd {shlex.quote(ROOT)}"]
    for i, (command, limit) in enumerate(zip(commands, limits)):
        out = shlex.quote(str(tmp_path / f"out{i}"))
        script.append(f"timeout -k 5 {limit} bash -c {shlex.quote(command)} > {out} 2>&1 < /dev/null; "
                      f"echo $? > {out}.rc")
    subprocess.run(["bash", "-c", "\n".join(script)], env=fresh_env(), timeout=sum(limit + 10 for limit in limits),
                   check=True)
    results = []
    for i in range(len(commands)):
        with open(tmp_path / f"out{i}", encoding="utf-8", errors="replace") as f, \
                open(tmp_path / f"out{i}.rc", encoding="ascii") as rc:
            results.append((int(rc.read()), f.read()))
    return results


def test_every_doc_command_is_classified() -> None:
    found = doc_commands()
    unknown = [f"{c!r} ({', '.join(pages)})" for c, pages in found.items() if c not in COMMANDS]
    stale = [c for c in COMMANDS if c not in found]
    assert not unknown, "doc commands not in COMMANDS; classify each (RUN, or why not):\n" + "\n".join(unknown)
    assert not stale, f"COMMANDS entries no page holds any more; drop them: {stale}"


def test_every_doc_command_names_the_venv() -> None:
    """A bare python/torchrun in a fresh shell is the machine's (no torch): `No module named 'torch'`."""
    bare = [f"{c!r} ({', '.join(pages)})" for c, pages in doc_commands().items()
            if c not in OWN_PYTHON and BARE & set(programs(c))]
    assert not bare, "commands that need an activated venv; write .venv/bin/python or .venv/bin/torchrun:\n" + \
        "\n".join(bare)


VENV_PYTHON = ".venv/bin/python"
SHELL_SYNTAX = set("|&;<>()$`*?~")


def python_argv(command: str) -> list[str] | None:
    """The arguments after ``.venv/bin/python`` of a command that is only that (no shell syntax), else None."""
    words = shlex.split(command)
    if words[:1] != [VENV_PYTHON] or len(words) < 2 or SHELL_SYNTAX & set(command):
        return None
    return words[1:]


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory) -> dict:
    """What the two tests below run, from one fresh shell and one tests/helpers/help_runner.py (one interpreter
    that imports torch, dynamo and megazero, ~5 CPU-seconds, instead of one per test): the RUN doc commands
    (plain ``.venv/bin/python ...`` ones forked by the runner, ``forked``; the others by bash as pasted,
    ``shell``; their (exit code, output) in ``ran``) and ``--help`` of every entry point (``scripts``: Python
    ones forked by the runner, shell scripts by bash; theirs in ``help``); ``runner``: the runner's own."""
    tmp = tmp_path_factory.mktemp("doc-runs")
    commands = [c for c in doc_commands() if COMMANDS.get(c) == RUN]
    forked = [c for c in commands if python_argv(c) is not None]
    shell = [c for c in commands if c not in forked]
    scripts = entry_points()
    python, sh = [s for s in scripts if not s.endswith(".sh")], [s for s in scripts if s.endswith(".sh")]
    argvs = [python_argv(c) for c in forked] + [[s, "--help"] for s in python]
    (tmp / "py").mkdir()
    (tmp / "argv").write_text("".join(json.dumps(argv) + "\n" for argv in argvs))
    runner = (f"{VENV_PYTHON} tests/helpers/help_runner.py {shlex.quote(str(tmp / 'py'))} --argv "
              f"{shlex.quote(str(tmp / 'argv'))}")
    # the runner's limit: the two runners' it replaces (each child has its own 60 s alarm)
    ran = run_in_fresh_shell([runner, *shell, *(f"bash {s} --help" for s in sh)], tmp, first_limit_s=240)
    py = [(int((tmp / "py" / f"{i}.rc").read_text()), (tmp / "py" / str(i)).read_text(errors="replace"))
          for i in range(len(argvs))] if ran[0][0] == 0 else [(-1, "")] * len(argvs)
    return {"runner": ran[0], "commands": commands, "forked": forked, "shell": shell,
            "ran": py[:len(forked)] + ran[1:1 + len(shell)], "scripts": python + sh,
            "help": py[len(forked):] + ran[1 + len(shell):]}


def test_cheap_doc_commands_run_as_pasted(doc_runs) -> None:
    """From one fresh shell: plain ``.venv/bin/python ...`` commands through tests/helpers/help_runner.py (one
    interpreter, a fork per command, as for --help), every other command by bash as pasted (``doc_runs``)."""
    commands, forked, shell = doc_runs["commands"], doc_runs["forked"], doc_runs["shell"]
    assert commands, "no doc command is run"
    assert forked and shell, (forked, shell)  # both paths stay exercised
    assert doc_runs["runner"][0] == 0, f"tests/helpers/help_runner.py failed:\n{doc_runs['runner'][1][-1500:]}"
    assert len(doc_runs["ran"]) == len(commands) == len(forked + shell)
    failed = [f"$ {c}\n(exit {rc})\n{out[-1500:]}" for c, (rc, out) in zip(forked + shell, doc_runs["ran"])
              if rc != 0 or not out.strip()]
    assert not failed, "doc commands that fail in a fresh shell:\n" + "\n".join(failed)


@pytest.mark.parametrize("command,argv", [
    (".venv/bin/python tools/plan_memory.py --tp 2", ["tools/plan_memory.py", "--tp", "2"]),
    (".venv/bin/python -m bench.run --groups tp", ["-m", "bench.run", "--groups", "tp"]),
    (".venv/bin/python tools/x.py 2>&1 | tail -3", None),
    (".venv/bin/torchrun --standalone pretrain_gpt.py", None),
    ("python tools/x.py", None),
])
def test_which_commands_fork(command, argv) -> None:
    assert python_argv(command) == argv


def entry_points() -> list[str]:
    """pretrain_gpt.py, every script in tools/, every .py a doc command runs and every module of this
    repository one runs with ``-m`` (named as a module: ``bench.run``)."""
    tools = sorted(os.path.relpath(p, ROOT) for ext in ("py", "sh") for p in glob.glob(os.path.join(ROOT, "tools",
                                                                                                     f"*.{ext}")))
    named = {m for c in doc_commands() for m in re.findall(r"(?<![\w/.])([\w/.-]+\.py)\b", c)}
    modules = {m for c in doc_commands() for m in re.findall(r"\s-m ([\w.]+)", c)
               if os.path.exists(os.path.join(ROOT, *m.split(".")) + ".py")}
    return ["pretrain_gpt.py"] + tools + sorted(named - set(tools) - {"pretrain_gpt.py"}) + sorted(modules)


def test_help_of_every_entry_point(doc_runs) -> None:
    """Python scripts through tests/helpers/help_runner.py (one interpreter, a fork per script: torch is
    imported once), shell scripts by bash; all from one fresh shell (``doc_runs``)."""
    scripts = doc_runs["scripts"]
    assert {"tools/plan_memory.py", "tools/launch_slurm.sh", "bench.run"} <= set(scripts), scripts
    assert doc_runs["runner"][0] == 0, f"tests/helpers/help_runner.py failed:\n{doc_runs['runner'][1][-1500:]}"
    assert len(doc_runs["help"]) == len(scripts)
    failed = [f"$ {s} --help\n(exit {rc})\n{out[-1500:]}" for s, (rc, out) in zip(scripts, doc_runs["help"])
              if int(rc) != 0 or "usage:" not in out.lower()]
    assert not failed, "--help that fails or prints no usage:\n" + "\n".join(failed)


@pytest.mark.parametrize("text,want", [
    ("```bash\n.venv/bin/python a.py \\\n    --x 1   # note\n# only a comment\n```\n", [".venv/bin/python a.py --x 1"]),
    ("```\n$ torchrun x.py\noutput line\n```\n", ["$ torchrun x.py"]),
    ("run `python b.py --y` or `make test`; flags `--tp 2`, `torchrun --nnodes 2`\n", ["python b.py --y",
                                                                                       "make test"]),
    ("<!-- plan:x begin -->\n```\npython tools/plan_memory.py $F\n```\n<!-- plan:x end -->\n", []),
    ("`.venv/bin/python -m bench.run --groups tp`, `python -m pytest`, `-m cuda`\n",
     [".venv/bin/python -m bench.run --groups tp", "python -m pytest"]),
])
def test_extraction(text: str, want: list[str]) -> None:
    """What counts as a command: the rules above, on small pages (a wrong rule would hide commands)."""
    assert _page_commands(text) == want
    assert [bool(BARE & set(programs(c))) for c in want] == [c.startswith(("$ torchrun", "python")) for c in want]
