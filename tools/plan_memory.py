"""Does it fit? Per-rank memory of a model and layout, or a search over layouts.

    python tools/plan_memory.py --config configs/tiny.yaml --tp 2 --pp 2 --dp 4 --zero 1 --bf16
    python tools/plan_memory.py --config configs/llama-7b.yaml --tp 2 --pp 4 --dp 8 --gpu-memory 80
    python tools/plan_memory.py ... --json            # one JSON object (bytes): {"mode": ..., "layouts": [...]}
    python tools/plan_memory.py ... --gpus 64 --gpu-memory 80 [--gpus-per-node 8]   # search
    python tools/plan_memory.py ... --offload-optimizer cpu|disk [--offload-params cpu|disk]   # host / disk bytes
    python tools/plan_memory.py ... --gpus 8 --gpu-memory 40 --search-offload    # also layouts needing offload
    python tools/plan_memory.py --write-docs          # regenerate the planner blocks of docs/

Takes pretrain_gpt.py's model and layout flags (``--cp`` included); ``--dp`` (default 1) stands in
for the world size the launcher would give. The search keeps the model, seq
length, precision and global batch, and varies tp (inside a node), cp (ring attention, where
the sequence splits into 2 x cp chunks), pp, dp,
zero, micro-batch and recompute (and with ``--search-offload`` the offload placement of
layouts that do not fit otherwise); a ``--tp``, ``--cp``, ``--pp``, ``--dp``, ``--ep`` or ``--etp``
given (on the command line or in a ``--config`` preset) is held: every layout listed has it.
Offload costs are assumption-based (bandwidths in ``megazero/memory/offload.py``).
``--offload-optimizer disk`` needs no real ``--offload-path`` here: the planner writes nothing.
Arithmetic: ``megazero.memory``.

It plans for a cluster from any machine and never asks this one's device. ``--recompute auto``
(the presets' default) is planned for the budget ``--memory-budget-gb`` or ``--gpu-memory`` gives,
as the run would choose; without either, every mode (none, selective, full) is listed. A line
above the table says which (in ``--json``, each plan's ``recompute_auto``).

The 7B and 70B tables in docs/memory_planner.md and docs/planner_7b.md are this tool's output,
pasted between ``<!-- plan:NAME begin -->`` / ``<!-- plan:NAME end -->``
markers by ``--write-docs``; tests/memory/test_docs_tables.py fails when they drift.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.arguments import build_parser, parse_config  # noqa: E402
from megazero.config import OFFLOAD_FLAGS, Config, Placement  # noqa: E402
from megazero.config_fields import Bounds  # noqa: E402
from megazero.memory import (PLANNED_PATH, Hardware, MemoryPlan, format_candidates, format_plan,  # noqa: E402
                             format_rows, planned_world, search_layouts, with_vocabulary)
from megazero.memory.recompute_choice import plan_for_cluster  # noqa: E402
from megazero.memory.search import HeldAxes  # noqa: E402

PROG = "plan_memory.py"
SEARCH_GPU_MEMORY_GIB = 80.0  # the search's GPU when --gpu-memory is not given

EXTRA = [
    ("--dp", {"type": int, "default": None, "help": "Data-parallel size to plan for (world = tp x cp x pp x dp; "
                                                    "default 1); in search mode, held like --tp/--pp/--ep."}),
    ("--json", {"action": "store_true", "help": "Print one JSON object (bytes) instead of the table: {\"mode\": "
                                                "\"plan\" or \"search\", \"layouts\": [...]}."}),
    ("--gpus", {"type": int, "default": None, "help": "Search mode: GPUs available; the --tp, --cp, --pp, --dp, --ep "
                                                      "and --etp given are held (every listed layout has them)."}),
    ("--gpu-memory", {"type": float, "default": None,
                      "help": f"Memory per GPU in GiB: the search's capacity (default {SEARCH_GPU_MEMORY_GIB:g}) and "
                              "--recompute auto's budget (default: every recompute mode listed)."}),
    ("--gpus-per-node", {"type": int, "default": 8, "help": "Search mode: GPUs per node (bounds --tp)."}),
    ("--top", {"type": int, "default": 20, "help": "Search mode: layouts to list."}),
    ("--peak-tflops", {"type": float, "default": 989.0, "help": "Search mode: dense peak per GPU."}),
    ("--efficiency", {"type": float, "default": 0.45, "help": "Search mode: achieved fraction of peak."}),
    ("--intra-node-gbps", {"type": float, "default": 450.0, "help": "Search mode: GB/s per GPU in a node."}),
    ("--inter-node-gbps", {"type": float, "default": 50.0, "help": "Search mode: GB/s per GPU across nodes."}),
    ("--headroom", {"type": float, "default": 0.1, "help": "Search mode: fraction of GPU memory kept free."}),
    ("--zero-stages", {"type": int, "nargs": "+", "choices": (0, 1, 2, 3), "default": None,
                       "help": "Plan the layout once per ZeRO stage given (overrides --zero): one row each, "
                               "the peak stage's figures."}),
    ("--offload-tiers", {"nargs": "+", "choices": OFFLOAD_FLAGS, "default": None,
                         "help": "With --zero-stages: one row per stage and --offload-optimizer placement given."}),
    ("--search-offload", {"action": "store_true", "help": "Search mode: retry layouts that do not fit with the "
                                                          "optimizer state (and ZeRO-3 parameters) offloaded."}),
    ("--host-memory", {"type": float, "default": 256.0, "help": "Search mode: host memory per GPU in GiB."}),
    ("--disk-space", {"type": float, "default": 3576.0, "help": "Search mode: offload disk per GPU in GiB."}),
    ("--write-docs", {"action": "store_true", "help": "Regenerate the planner tables in docs/memory_planner.md and "
                                                      "docs/planner_7b.md (other flags are ignored)."}),
]


EXTRA_BOUNDS = {"dp": Bounds(low=1), "gpus": Bounds(low=1), "gpu_memory": Bounds(low=0, low_open=True),
                "gpus_per_node": Bounds(low=1), "top": Bounds(low=1), "peak_tflops": Bounds(low=0, low_open=True),
                "efficiency": Bounds(low=0, low_open=True, high=1), "intra_node_gbps": Bounds(low=0, low_open=True),
                "inter_node_gbps": Bounds(low=0, low_open=True), "headroom": Bounds(low=0, high=1, high_open=True),
                "host_memory": Bounds(low=0), "disk_space": Bounds(low=0)}


def _check_extra_bounds(ns) -> None:
    """This tool's own numeric flags in range (the training flags are checked by the config)."""
    for name, bounds in EXTRA_BOUNDS.items():
        value = getattr(ns, name)
        if value is not None and not bounds.holds(value):
            raise ValueError(f"--{name.replace('_', '-')} must be {bounds}, got {value}; pass a value in that range.")


def _with_planned_path(argv: list[str]) -> list[str]:
    """``argv`` plus a stand-in --offload-path when disk offload is asked for without one."""
    word = Placement.DISK.flag_word
    disk = any(a in ("--offload-optimizer", "--offload-params") and i + 1 < len(argv) and argv[i + 1] == word
               for i, a in enumerate(argv)) or any(a in argv for a in (f"--offload-optimizer={word}",
                                                                        f"--offload-params={word}"))
    has_path = any(a == "--offload-path" or a.startswith("--offload-path=") for a in argv)
    return argv + ["--offload-path", PLANNED_PATH] if disk and not has_path else argv


def _stage_configs(argv: list[str], ns) -> list[Config]:
    """One config per --zero-stages entry, each parsed as if that stage were --zero (so a flag only that stage
    takes, --no-reshard-after-forward at ZeRO 3, is checked against it); else the one config."""
    stages = [["--zero", str(z)] for z in ns.zero_stages] if ns.zero_stages else [[]]
    return [parse_config(argv + zero, prog=PROG, extra=EXTRA)[0] for zero in stages]


def _plans(configs: list[Config], ns) -> list[tuple[MemoryPlan, str | None]]:
    """Each plan on tp x cp x pp x --dp ranks (one per config and --offload-tiers entry; under --recompute auto
    without a budget, one per mode), with the line saying how auto was planned."""
    out = []
    for cfg in configs:
        for tier in ns.offload_tiers or [None]:
            planned = cfg.updated(**_tier(tier, cfg)) if tier else cfg
            plans, note = plan_for_cluster(planned, planned_world(cfg, ns.dp or 1), ns.gpu_memory)
            out += [(plan, note) for plan in plans]
    return out


def _show_plans(planned: list[tuple[MemoryPlan, str | None]], as_json: bool, rows: bool) -> str:
    """The plans as JSON, one stage table, or one row each, after the --recompute auto lines (once each)."""
    if as_json:
        layouts = [{**p.to_dict(), **({"recompute_auto": note} if note else {})} for p, note in planned]
        return json.dumps({"mode": "plan", "layouts": layouts})
    notes = list(dict.fromkeys(note for _, note in planned if note))
    plans = [p for p, _ in planned]
    return "\n".join(notes + [format_rows(plans) if rows or len(plans) > 1 else format_plan(plans[0])])


def _tier(where: str, cfg) -> dict[str, object]:
    """Flat settings for --offload-optimizer ``where`` (a stand-in path while anything goes to disk)."""
    disk = Placement.DISK in (Placement.from_flag_word(where), Placement.from_flag_word(cfg.parallel.offload_params))
    return {"offload_optimizer": where, "offload_path": PLANNED_PATH if disk else None}


def report(argv: list[str]) -> tuple[int, str]:
    """(exit code, the text main() prints) for ``argv``; raises ValueError on bad input."""
    argv = _with_planned_path(list(argv))
    ns = build_parser(PROG, EXTRA, description=__doc__.splitlines()[0]).parse_args(argv)
    _check_extra_bounds(ns)
    configs = _stage_configs(argv, ns)
    if ns.gpus is None:
        return 0, _show_plans(_plans(configs, ns), ns.json, rows=bool(ns.zero_stages))
    cfg = configs[0]
    gpu_memory = SEARCH_GPU_MEMORY_GIB if ns.gpu_memory is None else ns.gpu_memory
    hw = Hardware(gpus=ns.gpus, gpu_memory_gib=gpu_memory, gpus_per_node=ns.gpus_per_node,
                  peak_flops=ns.peak_tflops * 1e12, efficiency=ns.efficiency,
                  intra_node_bandwidth=ns.intra_node_gbps * 1e9, inter_node_bandwidth=ns.inter_node_gbps * 1e9,
                  headroom=ns.headroom, host_memory_gib=ns.host_memory, disk_gib=ns.disk_space)
    held = HeldAxes.given(cfg, ns.dp)
    held.check(hw)
    cands = search_layouts(with_vocabulary(cfg), hw, offload=ns.search_offload, held=held)
    if ns.json:
        layouts = [{**c.plan.to_dict(), "step_seconds": c.step_seconds, "best": i == 0, "offload_only": c.offload_only}
                   for i, c in enumerate(cands[: ns.top])]
        return (0 if cands else 1), json.dumps({"mode": "search", "held": dict(held.items()), "layouts": layouts})
    return (0 if cands else 1), format_candidates(cands, hw, ns.top, held)


# -- the generated documentation blocks ------------------------------------------------------------
F_7B = ("--arch llama --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \\\n"
        "   --seq-length 4096 --vocab-size 32000 --bf16 --global-batch-size 512 --micro-batch-size 1")
SEARCH_7B = "--gpus 64 --gpu-memory 80 --gpus-per-node 8"
DP_ONLY_7B = ["--tp 1 --pp 1 --dp 64 --zero 1 --recompute full",
              "--tp 1 --pp 1 --dp 64 --zero 2 --recompute full --micro-batch-size 8",
              "--tp 1 --pp 1 --dp 64 --zero 3 --recompute full --micro-batch-size 8"]
ZERO_ROWS_7B = ["--tp 1 --pp 1 --dp 64 --recompute full --micro-batch-size 8 --zero-stages 0 1 2 3"]
F_70B = ("--arch llama --num-layers 80 --hidden-size 8192 --num-attention-heads 64 --num-query-groups 8 \\\n"
         "   --ffn-hidden-size 28672 --seq-length 4096 --vocab-size 128256 --bf16 --global-batch-size 1024 \\\n"
         "   --micro-batch-size 1 --recompute full")
ZERO_ROWS_70B = ["--tp 8 --pp 8 --dp 8 --sequence-parallel --zero-stages 1 2 3",
                 "--tp 8 --pp 4 --dp 32 --sequence-parallel --zero-stages 1 2 3",
                 "--tp 1 --pp 1 --dp 1024 --main-grads-dtype bf16 --zero-stages 1 2 3",
                 "--tp 1 --pp 1 --dp 1024 --main-grads-dtype bf16 --no-reshard-after-forward --zero-stages 3"]
F_LONG = ("--arch llama --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --num-query-groups 1 \\\n"
          "   --ffn-hidden-size 5632 --seq-length 262152 --vocab-size 32000 --bf16 --global-batch-size 8 \\\n"
          "   --micro-batch-size 1")
CP_LONG = ["--gpus 8 --gpu-memory 80 --top 6", "--cp 2 --dp 4 --zero 1 --recompute full"]
OFFLOAD_7B = ["--gpus 1 --gpu-memory 80 --search-offload --top 4",
              "--tp 1 --pp 1 --dp 8 --recompute full --micro-batch-size 8 --zero-stages 1 3 "
              "--offload-tiers none cpu disk"]
OFFLOAD_PARAMS_7B = ["--tp 1 --pp 1 --dp 8 --recompute full --micro-batch-size 8 --zero 3 --offload-optimizer cpu "
                     "--offload-params cpu --zero-stages 3 --offload-tiers cpu disk",
                     "--gpus 8 --gpu-memory 16 --search-offload --top 4"]


def _run_block(flags: list[str], with_f: bool, model: str = F_7B, var: str = "F") -> str:
    """A fenced block: each command (on the ${var} model flags ``model``) followed by its output."""
    parts = [f'{var}="{model}"'] if with_f else []
    for i, f in enumerate(flags):
        _, text = report(shlex.split(model.replace("\\\n", " ")) + shlex.split(f))
        parts += ([""] if i or with_f else []) + [f".venv/bin/python tools/plan_memory.py ${var} {f}", text]
    return "```\n" + "\n".join(parts) + "\n```"


def best_layout_flags() -> str:
    """The flags of the search's fastest layout (so the docs' stage-by-stage block follows the search)."""
    cfg, ns = parse_config(shlex.split(F_7B.replace("\\\n", " ")) + shlex.split(SEARCH_7B), extra=EXTRA)
    hw = Hardware(gpus=ns.gpus, gpu_memory_gib=ns.gpu_memory, gpus_per_node=ns.gpus_per_node)
    s = search_layouts(with_vocabulary(cfg), hw)[0].spec
    r = s.run
    return (f"--tp {r.tp}{f' --cp {r.cp}' if r.cp > 1 else ''} --pp {r.pp} --dp {r.dp} --zero {int(r.zero)} "
            f"--micro-batch-size {r.micro_batch_size} "
            f"--recompute {s.cfg.training.recompute}{' --sequence-parallel' if s.sequence_parallel else ''}")


def doc_blocks() -> dict[str, dict[str, str]]:
    """File (relative to the repository) -> block name -> generated block text."""
    return {
        "docs/memory_planner.md": {"7b": _run_block([f"{SEARCH_7B} --top 8"] + ZERO_ROWS_7B, with_f=True),
                                   "70b": _run_block(ZERO_ROWS_70B, with_f=True, model=F_70B, var="F70"),
                                   "offload": _run_block(OFFLOAD_7B, with_f=False),
                                   "cp": _run_block(CP_LONG, with_f=True, model=F_LONG, var="FL")},
        "docs/planner_7b.md": {"7b-search": _run_block([f"{SEARCH_7B} --top 12"], with_f=True),
                               "7b-best": _run_block([best_layout_flags()], with_f=False),
                               "7b-dp": _run_block(DP_ONLY_7B + ZERO_ROWS_7B, with_f=False),
                               "70b": _run_block(ZERO_ROWS_70B, with_f=True, model=F_70B, var="F70"),
                               "offload": _run_block(OFFLOAD_7B + OFFLOAD_PARAMS_7B, with_f=False)},
    }


def replace_blocks(text: str, blocks: dict[str, str], path: str) -> str:
    """``text`` with the body between each block's begin/end markers replaced by the block."""
    for name, body in blocks.items():
        tag = re.escape(name)
        pattern = re.compile(rf"(<!-- plan:{tag} begin -->\n)(?:.*?\n)?(<!-- plan:{tag} end -->)", re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"{path} has no '<!-- plan:{name} begin -->' ... '<!-- plan:{name} end -->' markers; "
                             f"add them where the generated table belongs.")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text, count=1)
    return text


def write_docs(root: str = ROOT) -> list[str]:
    """Regenerate every block in place; returns the files that changed."""
    changed = []
    for rel, blocks in doc_blocks().items():
        path = os.path.join(root, rel)
        with open(path, encoding="utf-8") as f:
            old = f.read()
        new = replace_blocks(old, blocks, rel)
        if new != old:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            changed.append(rel)
    return changed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if "--write-docs" in argv:
            changed = write_docs()
            print(f"rewrote {', '.join(changed)}" if changed else "planner tables already up to date")
            return 0
        code, text = report(argv)
        print(text)
        return code
    except ValueError as err:
        print(f"plan_memory.py: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
