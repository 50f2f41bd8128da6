"""Does it fit? Per-rank memory of a model and layout, or a search over layouts.

    python tools/plan_memory.py --config configs/tiny.yaml --tp 2 --pp 2 --dp 4 --zero 1 --bf16
    python tools/plan_memory.py ... --json            # one JSON object (bytes)
    python tools/plan_memory.py ... --gpus 64 --gpu-memory 80 [--gpus-per-node 8]   # search

Takes pretrain_gpt.py's model and layout flags; ``--dp`` (default 1) stands in
for the world size the launcher would give. The search keeps the model, seq
length, precision and global batch, and varies tp (inside a node), pp, dp,
zero, micro-batch and recompute. Arithmetic: ``megazero.memory``.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.arguments import parse_config  # noqa: E402
from megazero.memory import (Hardware, format_candidates, format_plan, plan_for_run,  # noqa: E402
                             search_layouts)

EXTRA = [
    ("--dp", {"type": int, "default": 1, "help": "Data-parallel size to plan for (world = tp x pp x dp)."}),
    ("--json", {"action": "store_true", "help": "Print one JSON object (bytes) instead of the table."}),
    ("--gpus", {"type": int, "default": None, "help": "Search mode: GPUs available."}),
    ("--gpu-memory", {"type": float, "default": 80.0, "help": "Search mode: memory per GPU in GiB."}),
    ("--gpus-per-node", {"type": int, "default": 8, "help": "Search mode: GPUs per node (bounds --tp)."}),
    ("--top", {"type": int, "default": 20, "help": "Search mode: layouts to list."}),
    ("--peak-tflops", {"type": float, "default": 989.0, "help": "Search mode: dense peak per GPU."}),
    ("--efficiency", {"type": float, "default": 0.45, "help": "Search mode: achieved fraction of peak."}),
    ("--intra-node-gbps", {"type": float, "default": 450.0, "help": "Search mode: GB/s per GPU in a node."}),
    ("--inter-node-gbps", {"type": float, "default": 50.0, "help": "Search mode: GB/s per GPU across nodes."}),
    ("--headroom", {"type": float, "default": 0.1, "help": "Search mode: fraction of GPU memory kept free."}),
]


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, ns = parse_config(argv, prog="plan_memory.py", extra=EXTRA)
        if ns.gpus is None:
            plan = plan_for_run(cfg, cfg.parallel.tp * cfg.parallel.pp * ns.dp)
            print(json.dumps(plan.to_dict()) if ns.json else format_plan(plan))
            return 0
        hw = Hardware(gpus=ns.gpus, gpu_memory_gib=ns.gpu_memory, gpus_per_node=ns.gpus_per_node,
                      peak_flops=ns.peak_tflops * 1e12, efficiency=ns.efficiency,
                      intra_node_bandwidth=ns.intra_node_gbps * 1e9, inter_node_bandwidth=ns.inter_node_gbps * 1e9,
                      headroom=ns.headroom)
        cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
        base = plan_for_run(cfg, 1).spec
        cands = search_layouts(base, hw, cfg.training.global_batch_size)
        if ns.json:
            print(json.dumps([{**c.plan.to_dict(), "step_seconds": c.step_seconds, "best": i == 0}
                              for i, c in enumerate(cands[: ns.top])]))
        else:
            print(format_candidates(cands, hw, ns.top))
        return 0 if cands else 1
    except ValueError as err:
        print(f"plan_memory.py: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
