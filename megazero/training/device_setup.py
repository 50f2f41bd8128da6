"""Process-wide switches a run sets before CUDA initialises: the two environment variables
CUDA reads once, and ``--deterministic``'s kernel choices.

``CUDA_DEVICE_MAX_CONNECTIONS=1`` (with tp > 1 on CUDA). megazero's TP layers
launch a communication kernel and then a GEMM meant to overlap with it (the
sequence-parallel all-gather of the input during the dX GEMM, layers.py).
With CUDA's default of 8 hardware queues the device may start the GEMM first
and let it take every SM, so the collective waits behind it; with one queue
kernels start in the order they were launched. Megatron-LM refuses sequence
parallelism without it (``validate_args``); here it is set for the user, unless
they set it. It is read when the CUDA context is created, so it is set before
anything touches the device.

``--deterministic``: bitwise-reproducible kernels. cuBLAS needs a fixed
workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, read when its handle is made)
to pick the same reduction order every call; ``use_deterministic_algorithms``
makes PyTorch choose deterministic kernels and raise on an op that has none;
cuDNN's autotuner is switched off. Attention is where it shows: on an H100
with torch 2.11 (2026-11-22), dQ of SDPA's backward at the llama-1b shape
(4 x 32 heads x 2048 x 64, bf16) differed from one call to the next on the
flash, memory-efficient and cuDNN backends; in deterministic mode flash and
memory-efficient repeated bit for bit, and cuDNN attention (torch's first
choice there otherwise) refused to run, so SDPA falls back to the others. A
resumed run is bitwise the uninterrupted one only if every step is repeatable,
hence this flag. On CPU the losses are the same with and without it.
"""
from __future__ import annotations

import os
from typing import MutableMapping

import torch

from ..config import Config

MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_CUBLAS_WORKSPACE = ":4096:8"  # 8 workspaces of 4 MiB (NVIDIA's cuBLAS reproducibility notes)


def prepare_cuda_env(cfg: Config, env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the CUDA environment variables this run needs and the user left unset; returns what was set.

    Call before CUDA initialises. ``--device auto`` counts as CUDA: asking whether a GPU exists
    could initialise the driver, and both variables do nothing in a CPU-only process.
    """
    wanted: dict[str, str] = {}
    if cfg.training.device != "cpu" and cfg.parallel.tp > 1:
        wanted[MAX_CONNECTIONS] = "1"
    if cfg.training.deterministic:
        wanted[CUBLAS_WORKSPACE] = DETERMINISTIC_CUBLAS_WORKSPACE
    set_now = {name: value for name, value in wanted.items() if name not in env}
    env.update(set_now)
    return set_now


def apply_determinism(deterministic: bool) -> None:
    """``--deterministic``: deterministic kernels for the rest of this process (see the module docstring)."""
    if not deterministic:
        return
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
