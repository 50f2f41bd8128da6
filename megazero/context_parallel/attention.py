"""The attention core under context parallelism: the one place attention knows about CP.

``cp_attention`` takes this rank's q [b, n, s, d] and k/v [b, g, s, d] (s = S/cp tokens in
``CPSplit`` local order, GQA when g < n), and returns causal softmax(QK^T/sqrt(d))V of those queries
over the whole sequence, in the same order:

    p2p      ring over the CP group (``ring.ring_attention``), load-balanced split
    a2a      all-to-all to n/cp heads of the whole sequence, SDPA, all-to-all back (``ulysses``)
    a2a+p2p  all-to-all inside the group of U (each rank then holds its ring position's two
             chunks whole, for n/U heads), the ring over the R ring positions, all-to-all back

No attention dropout: the config refuses it with cp > 1. ``bounds`` (packed documents,
``doc_blocks``): every form keeps attention inside each document; a2a runs one SDPA per document.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import CPContext
from .doc_blocks import Bounds, document_attention
from .logit_max import LogitMax, whole_sequence_logit_max
from .ring import ring_attention
from .ulysses import ulysses_attention


def cp_attention(q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor, cp: CPContext,
                 bounds: Bounds | None = None, logit_max: LogitMax | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over every CP rank's keys (see the module docstring).
    ``logit_max`` (QK-clip): each form adds the per-head maximum logit of the blocks it attends."""
    if logit_max is not None and not cp.active:
        whole_sequence_logit_max(logit_max, q_bnsd, k_bgsd, bounds)
    if not cp.active and bounds is not None:
        return document_attention(q_bnsd, k_bgsd, v_bgsd, bounds)
    if not cp.active:
        return F.scaled_dot_product_attention(q_bnsd, k_bgsd, v_bgsd, is_causal=True,
                                              enable_gqa=q_bnsd.shape[1] != k_bgsd.shape[1])
    if cp.comm_type == "p2p":
        return ring_attention(q_bnsd, k_bgsd, v_bgsd, cp.ring_group if cp.ring_group is not None else cp.group,
                              bounds=bounds, logit_max=logit_max)
    if cp.comm_type == "a2a":
        return ulysses_attention(q_bnsd, k_bgsd, v_bgsd, cp.a2a_group if cp.a2a_group is not None else cp.group,
                                 bounds=bounds, logit_max=logit_max)
    if cp.comm_type == "a2a+p2p":
        assert cp.a2a_group is not None and cp.ring_group is not None, "a2a+p2p needs both CP subgroups"
        return ulysses_attention(q_bnsd, k_bgsd, v_bgsd, cp.a2a_group, pieces=2, logit_max=logit_max,
                                 inner=functools.partial(ring_attention, group=cp.ring_group, bounds=bounds))
    raise ValueError(f"--cp-comm-type must be one of p2p, a2a, a2a+p2p; got {cp.comm_type!r}")
