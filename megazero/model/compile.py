"""Regional ``torch.compile`` (``--compile``): each transformer block's body, kept in its ``compiled_body`` field.

Why regional: compiling the whole model makes compile time grow with depth and
hides the module boundaries that ZeRO 3 (forward pre/post hooks per unit),
recompute (checkpoint wrappers per block) and pipeline stages (a chunk per
stage) are built on. Here only ``TransformerBlock.body`` - not ``block.__call__``
nor the ``forward`` that picks it and checkpoints it - is compiled, so every module hook still fires in eager
around it. All blocks run the same code object with the same guards, so they
share one compiled graph (one compile per distinct input shape / grad mode,
not per layer); ``dynamic=False`` because a run's activation shapes are fixed.

What stays eager (a graph break; everything else of the block is one graph):

- *Dropout that draws.* A block draws its masks from its layer's streams
  (``DropoutRNG.fork`` swaps the stream into the default generator), which
  dynamo cannot trace, and inductor's own RNG would draw different masks than
  eager anyway. So with ``hidden_dropout`` / ``attention_dropout`` > 0 the
  drawing call (``_dropout``, ``core_attention``) runs eager, exactly as
  without ``--compile``. At dropout 0 nothing is drawn, so compiled blocks get
  a context without streams (``rng=None``): the fork would be a no-op that
  only breaks the graph. Those layers' streams are then never created, which
  a checkpoint records as "never drawn" - the same state.
- *Selective recompute*: the checkpointed attention core (``recompute.py``), so recompute is set
  first (``apply_recompute`` refuses a compiled block).
- *Context parallelism*: the attention core's ring / all-to-all collectives.
- *Mixture of experts*: the MoE layer (``moe/layer.py``) sizes its all-to-all and grouped GEMM from token
  counts read on the host, routes differently every step (shapes that change), and its router counts
  tokens only outside backward (a recompute): it runs eager whole; attention and norms stay compiled.
- *Tensor parallelism*: the TP layers' communicating autograd Functions
  (``tensor_parallel/comm.py``, ``layers.py``) are not traceable; dynamo breaks
  around each, so a TP block compiles into the regions between its collectives.

Each graph break is a field the block's code reads (``TransformerBlock.dropout_eager``,
``Attention.core_eager``). Full recompute checkpoints the compiled body (``TransformerBlock.forward``),
so the recompute in backward runs the same compiled code. ``fullgraph=True`` wherever
none of the above applies (tp 1, dropout 0, recompute none/full, cp 1).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from ..moe.layer import MoELayer
from .chunk import blocks_of
from .transformer import TransformerBlock, make_eager_sites


def eager_sites(block: TransformerBlock) -> list[str]:
    """What of ``block`` runs eager under --compile (see the module docstring); empty means one graph.

    The attention core forks its layer's stream whenever the context has streams (even to draw
    nothing), runs CP collectives, or is recompute's checkpoint wrapper.
    """
    sites = ["_dropout"] if block.cfg.hidden_dropout > 0.0 else []
    if isinstance(block.mlp, MoELayer):
        sites.append("mlp")
    if block.ctx.rng is not None or block.ctx.cp.active or block.attention.recompute_core:
        sites.append("attention.core_attention")
    return sites


def compile_block(block: TransformerBlock, backend: str = "inductor") -> bool:
    """Compile ``block``'s body into ``block.compiled_body``; returns whether it is one graph (``fullgraph``)."""
    if block.compiled_body is not None:
        raise ValueError("--compile: block already compiled; apply_compile runs once per built chunk.")
    draws = block.cfg.hidden_dropout > 0.0 or block.cfg.attention_dropout > 0.0
    if not draws and block.ctx.rng is not None:  # nothing is drawn: drop the fork that would break the graph
        ctx = dataclasses.replace(block.ctx, rng=None)
        block.ctx = block.attention.ctx = ctx
    sites = eager_sites(block)
    make_eager_sites()
    block.dropout_eager = "_dropout" in sites
    block.attention.core_eager = "attention.core_attention" in sites
    block.mlp_eager = "mlp" in sites
    fullgraph = not sites and block.ctx.tp == 1
    block.compiled_body = torch.compile(block.body, fullgraph=fullgraph, dynamic=False, backend=backend)
    return fullgraph


def apply_compile(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every block of ``model`` (a built chunk); returns how many. Recompute is set before
    (``training/parallelize.py``): the graph breaks follow its mode."""
    blocks = blocks_of(model)
    for block in blocks:
        compile_block(block, backend)
    return len(blocks)


def compile_seconds() -> float:
    """Seconds dynamo and inductor have spent compiling in this process (forward and backward graphs)."""
    metrics = torch._dynamo.utils.compilation_time_metrics
    keys = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
    return sum(sum(metrics.get(k, [])) for k in keys)


def compile_report(num_blocks: int, say: Callable[[str], None]) -> Callable[[], None]:
    """The trainer's first-step callback under --compile: the forward and backward graphs compile during
    the first step, so after it, say once how long compiling took."""
    return lambda: say(f"megazero: --compile: compiled {num_blocks} block(s) in {compile_seconds():.1f} s")
