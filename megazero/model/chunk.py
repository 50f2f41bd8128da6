"""The one way to find the blocks of a built model chunk.

Whatever wraps blocks from outside - recompute, compile, ZeRO 3's units and gather waits, the
compile report - walks them with ``blocks_of``, so all of them agree on which modules are blocks
and in which order (forward order: the chunk registers its blocks in the order it runs them).
"""
from __future__ import annotations

from torch import nn

from ..moe.router import Router
from .transformer import TransformerBlock


def blocks_of(chunk: nn.Module) -> list[TransformerBlock]:
    """The transformer blocks of ``chunk`` (a ``GPTModel``, or any module holding blocks), in forward order."""
    return [m for m in chunk.modules() if isinstance(m, TransformerBlock)]


def routers_of(chunk: nn.Module) -> list[Router]:
    """The MoE routers of ``chunk``, in forward order (what sets their loss scaling or resets their bias)."""
    return [m for m in chunk.modules() if isinstance(m, Router)]
