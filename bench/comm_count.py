"""Bytes communicated per rank, counted at the torch.distributed call level, alike for every entry.

``install()`` wraps the collectives of ``torch.distributed`` (and of the
functional collectives DTensor uses) with counting wrappers: the real
collective still runs, unchanged. Counts use megazero's ledger formulas
(``megazero/parallel/collectives.py``), N ranks in the group, B bytes:

    all_reduce            2 (N-1)/N * B
    reduce_scatter          (N-1)/N * B   (B = the full input)
    reduce                  (N-1)/N * B   (what a reduce-scatter of B moves)
    all_gather              (N-1)/N * B   (B = the full output)
    broadcast               (N-1)/N * B
    send / isend            B

A collective issued inside another wrapped one (e.g. ``batch_isend_irecv``
calling ``isend``) is counted once, by the outermost call. Aliases bound before
``install()`` (``X = dist.all_gather_single`` in an imported module) are re-pointed too. Counting is off
until ``COUNTER.enabled`` is set, so start-up and metadata exchanges stay out.
"""
from __future__ import annotations

import functools
import sys
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist

# packages whose module-level aliases of torch.distributed functions are re-pointed at the wrappers
ALIAS_PACKAGES = ("torch.distributed", "megazero", "megatron", "deepspeed", "bench", "tests")


class Counter:
    def __init__(self) -> None:
        self.enabled = False
        self.depth = 0
        self.bytes: dict[str, float] = defaultdict(float)
        self.installed = False

    def add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += nbytes

    def take(self) -> dict[str, float]:
        out = dict(self.bytes)
        self.bytes.clear()
        return out


COUNTER = Counter()


def _nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    if hasattr(t, "_local_tensor"):
        t = t._local_tensor
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def group_size(group: Any) -> int:
    """Ranks in a c10d group, a DeviceMesh, a (mesh, dim) pair, a rank list or a group name."""
    if group is None:
        return dist.get_world_size()
    if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "size"):
        return group[0].size(group[1])
    if hasattr(group, "size") and hasattr(group, "mesh"):
        return group.size()
    if isinstance(group, list):
        return len(group)
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return dist.get_world_size(_resolve_process_group(group))
    return dist.get_world_size(group)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


# kind, formula(args, kwargs) -> bytes; positional indices follow each function's signature
def _ring(kind: str, tensor_index: int, tensor_name: str, group_index: int, factor: float
          ) -> Callable[[tuple, dict], tuple[str, float]]:
    def measure(args: tuple, kwargs: dict) -> tuple[str, float]:
        n = group_size(_arg(args, kwargs, group_index, "group"))
        b = _nbytes(_arg(args, kwargs, tensor_index, tensor_name))
        return kind, factor * (n - 1) / n * b if n > 1 else 0.0
    return measure


def _send(tensor_index: int) -> Callable[[tuple, dict], tuple[str, float]]:
    return lambda args, kwargs: ("send", float(_nbytes(_arg(args, kwargs, tensor_index, "tensor"))))


def _batch(args: tuple, kwargs: dict) -> tuple[str, float]:
    ops = _arg(args, kwargs, 0, "p2p_op_list")
    return "send", float(sum(_nbytes(op.tensor) for op in ops if op.op.__name__ in ("isend", "send")))


C10D_RULES: dict[str, Callable] = {
    "all_reduce": _ring("all_reduce", 0, "tensor", 2, 2.0),
    "all_reduce_coalesced": _ring("all_reduce", 0, "tensors", 2, 2.0),
    "reduce_scatter_tensor": _ring("reduce_scatter", 1, "input", 3, 1.0),
    "_reduce_scatter_base": _ring("reduce_scatter", 1, "input", 3, 1.0),
    "reduce_scatter": _ring("reduce_scatter", 1, "input_list", 3, 1.0),
    "reduce_scatter_single": _ring("reduce_scatter", 1, "input", 3, 1.0),
    "reduce": _ring("reduce", 0, "tensor", 3, 1.0),
    "all_gather_into_tensor": _ring("all_gather", 0, "output_tensor", 2, 1.0),
    "_all_gather_base": _ring("all_gather", 0, "output_tensor", 2, 1.0),
    "all_gather": _ring("all_gather", 0, "tensor_list", 2, 1.0),
    "all_gather_single": _ring("all_gather", 0, "output_tensor", 2, 1.0),
    "all_gather_coalesced": _ring("all_gather", 0, "output_tensor_lists", 2, 1.0),
    "broadcast": _ring("broadcast", 0, "tensor", 2, 1.0),
    "send": _send(0),
    "isend": _send(0),
    "batch_isend_irecv": _batch,
}
FUNCOL_RULES: dict[str, Callable] = {
    "all_reduce": _ring("all_reduce", 0, "self", 2, 2.0),
    "all_gather_tensor": lambda a, k: ("all_gather", _gathered(a, k)),
    "all_gather_tensor_autograd": lambda a, k: ("all_gather", _gathered(a, k)),
    "reduce_scatter_tensor": _ring("reduce_scatter", 0, "self", 3, 1.0),
    "reduce_scatter_tensor_autograd": _ring("reduce_scatter", 0, "self", 3, 1.0),
}


def _gathered(args: tuple, kwargs: dict) -> float:
    n = group_size(_arg(args, kwargs, 2, "group"))
    return (n - 1) * _nbytes(_arg(args, kwargs, 0, "self"))  # (N-1)/N of the N-times-larger output


def _wrap(fn: Callable, rule: Callable) -> Callable:
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        if COUNTER.enabled and COUNTER.depth == 0:
            kind, nbytes = rule(args, kwargs)
            COUNTER.add(kind, nbytes)
        COUNTER.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            COUNTER.depth -= 1
    counted.__wrapped_collective__ = fn
    return counted


def _rebind_aliases(replaced: dict[int, Callable]) -> None:
    """Point module-level aliases of the wrapped functions (``_GATHER = dist.all_gather_single``) at the wrappers."""
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith(ALIAS_PACKAGES):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and id(value) in replaced:
                setattr(module, attr, replaced[id(value)])


def install() -> Counter:
    """Wrap the collectives once per process (before importing the library under test)."""
    if COUNTER.installed:
        return COUNTER
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    # one wrapper per function, set on both modules: P2POp checks ``op in [isend, irecv]`` by identity
    replaced: dict[int, Callable] = {}
    for module, rules in ((c10d, C10D_RULES), (funcol, FUNCOL_RULES)):
        for name, rule in rules.items():
            fn = getattr(module, name, None)
            if fn is not None and not hasattr(fn, "__wrapped_collective__"):
                replaced[id(fn)] = _wrap(fn, rule)
                setattr(module, name, replaced[id(fn)])
    _rebind_aliases(replaced)
    COUNTER.installed = True
    return COUNTER
