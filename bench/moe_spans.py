"""pretrain_gpt.py with every MoE layer's forward and backward timed: how much of a step the MoE layers take.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m bench.moe_spans OUT <pretrain_gpt.py flags>

Each rank appends one line per MoE layer call to OUT.rank<N> (JSON: forward seconds, backward seconds),
written after training ends so the writes stay out of the steps. The forward span is the layer's call;
the backward span runs from the moment the gradient of the layer's output arrives to the moment the
gradient of its input is complete (the autograd engine runs the layer's backward nodes in between).
Used by ``bench/bench_moe_model.py``, which sets the blocked all-to-all time (``--log-timers``, the
``ep`` axis) against these spans.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from megazero.moe.layer import MoELayer

SPANS: list[dict[str, float]] = []


def _timed(forward):
    def timed_forward(self: MoELayer, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = forward(self, x)
        span = {"forward": time.perf_counter() - start, "backward": 0.0}
        SPANS.append(span)
        if out.requires_grad and x.requires_grad:
            arrived: list[float] = []
            out.register_hook(lambda grad: arrived.append(time.perf_counter()))
            x.register_hook(lambda grad: span.__setitem__("backward", time.perf_counter() - arrived[-1]))
        return out

    return timed_forward


def main() -> None:
    out_path = sys.argv[1]
    sys.argv = ["pretrain_gpt.py", *sys.argv[2:]]
    MoELayer.forward = _timed(MoELayer.forward)  # type: ignore[method-assign]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pretrain_gpt

    code = pretrain_gpt.main() or 0
    with open(f"{out_path}.rank{os.environ.get('RANK', '0')}", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in SPANS)
    sys.stdout.flush()
    os._exit(code)  # as pretrain_gpt.py: skip gloo's thread teardown at interpreter exit


if __name__ == "__main__":
    main()
