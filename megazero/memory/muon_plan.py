"""What ``--optimizer muon`` adds to a rank's memory: its optimizer state, and the Newton-Schulz (NS) workspace.

State. Muon keeps one fp32 moment per parameter where AdamW keeps two: the store (``optimizer/offload.py``,
``kept``) allocates ``exp_avg`` (Muon's momentum) for every element and ``exp_avg_sq`` for the AdamW-trained ones
only (embeddings, head, norms, biases, router), so per element of a rank's shard, plus the fp32 master copy in
mixed precision:

    AdamW-trained   K = 12 mixed precision, 8 fp32       (two moments)
    Muon-trained    K = 8 mixed precision, 4 fp32        (one moment)

and at ZeRO 1 in the ZeRO paper's mixed precision (2-byte weights and gradients) a parameter costs 4 + 12 / N
bytes under AdamW and, for the Muon-trained matrices, 4 + 8 / N. The planner charges AdamW's K for the whole
shard and takes back 4 bytes per Muon-trained element of it (``one_moment_saving``: the stage's Muon elements,
TP/EP-local, over the ranks the state is sharded over), on the device or, offloaded, in the host copy and the
disk file (the disk tier's buffers are sized for AdamW's three tensors either way). Measured against real
steps in ``tests/memory/test_muon_memory.py``.

Workspace. ``optimizer.muon.orthogonalise`` on an (m, n) matrix with m <= n (a tall one is transposed) holds at
its peak the iterate X and the next one (m n each) with A = X X^T and B = bA + cA^2 (m^2 each):
2 m n + 2 m^2 elements of the NS dtype (``--muon-ns-dtype``: 4 bytes in fp32, 2 in bf16), its result included
(measured op by op in that test). NS runs on
the matrix's owner after the backward has freed the activations, one matrix at a time, so a stage's figure is
the workspace of its largest Muon matrix: the rank that owns that matrix needs it (``ns_workspace_bytes``).
Not counted: the step's gathered directions and NS outputs (``muon_shards``), which the communication formula
in docs/optimizers.md sizes.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, Sequence

import torch

from ..config import Config, ModelConfig, Placement
from ..model.transformer import TPContext, TransformerBlock
from ..optimizer.muon import NS_DTYPES, matrices_of, matrix_shape, takes_muon
from ..run_plan import RunPlan
from ..tensor_parallel.layers import spec_of
from .offload import OffloadBytes
from .zero3 import PeakState

MUON_MOMENTS_ALLOCATED = 1  # exp_avg (the momentum); exp_avg_sq only for the AdamW-trained elements


def uses_muon(cfg: Config) -> bool:
    return cfg.optimizer.optimizer == "muon"


def optimizer_state_bytes(k_adamw: int, cfg: Config) -> int:
    """K, the optimizer-state bytes per element of a shard the planner charges: AdamW's ``k_adamw`` (master + 2
    moments) for both optimizers; under Muon ``one_moment_saving`` takes back the Muon elements' second moment."""
    return k_adamw


@lru_cache(maxsize=64)
def block_muon_numels(cfg: ModelConfig, layer_id: int) -> tuple[tuple[int, bool, bool], ...]:
    """(elements, TP-split?, expert?) of each Muon weight of block ``layer_id``, full size (a meta-device block)."""
    with torch.device("meta"):
        block = TransformerBlock(cfg, TPContext(), layer_id=layer_id)
    return tuple((p.numel(), spec_of(p).split_dim is not None, spec_of(p).expert)
                 for name, p in block.named_parameters() if takes_muon(name, p))


def one_moment_saving(cfg: Config, run: RunPlan, layer_ids: list[int]) -> float:
    """Bytes of second moment a rank of ``run`` holding blocks ``layer_ids`` does not keep under Muon: 4 per
    Muon-trained element of its shards (dense weights split over tp, sharded over dp x cp at ZeRO >= 1; routed
    experts over ep and etp, sharded over edp). 0 for AdamW."""
    if not uses_muon(cfg):
        return 0.0
    dense = expert = 0.0
    for layer in layer_ids:
        for numel, split, is_expert in block_muon_numels(cfg.model, layer):
            if is_expert:
                expert += numel / run.ep / (run.etp if split else 1)
            else:
                dense += numel / (run.tp if split else 1)
    sharded = run.zero.shards_optimizer_state
    return 4 * (dense / (run.dp * run.cp if sharded else 1) + expert / (run.layout.expert.edp if sharded else 1))


def with_one_moment(cfg: Config, run: RunPlan, layer_ids: list[int], state: PeakState,
                    off: OffloadBytes) -> tuple[PeakState, OffloadBytes]:
    """A stage's model state and offloaded bytes less ``one_moment_saving`` (where the optimizer state lives)."""
    saving = one_moment_saving(cfg, run, layer_ids)
    if not saving:
        return state, off
    where = run.placement.optimizer_state
    off = replace(off, optimizer_host=off.optimizer_host - (saving if where is Placement.HOST else 0),
                  optimizer_disk=off.optimizer_disk - (saving if where is Placement.DISK else 0))
    return replace(state, optimizer=state.optimizer - saving, persistent=state.persistent - saving), off


def ns_workspace_elements(shape: tuple[int, int]) -> int:
    """Elements ``orthogonalise`` holds at its peak on an (out, in) matrix: 2 m n + 2 m^2, m the shorter side."""
    m, n = sorted(shape)
    return 2 * m * n + 2 * m * m


@lru_cache(maxsize=64)
def block_matrix_shapes(cfg: ModelConfig, layer_id: int) -> tuple[tuple[int, int], ...]:
    """The (out, in) shapes of the Muon matrices of block ``layer_id`` (full, TP-joined; fused weights split by
    ``matrices_of``), read from a block built on the meta device, so they follow the optimizer's own rules."""
    with torch.device("meta"):
        block = TransformerBlock(cfg, TPContext(), layer_id=layer_id)
    shapes = []
    for name, p in block.named_parameters():
        if takes_muon(name, p):
            shapes += [matrix_shape(p.shape, m) for m in matrices_of(name, p.shape, cfg)]
    return tuple(shapes)


def ns_dtype_bytes(cfg: Config) -> int:
    """Bytes per element of the dtype NS runs in (``--muon-ns-dtype``, ``MuonHyper.ns_dtype``)."""
    return NS_DTYPES[cfg.optimizer.muon_ns_dtype].itemsize


def ns_workspace_bytes(cfg: Config, layer_ids: list[int]) -> int:
    """Bytes of the NS workspace of the largest Muon matrix in blocks ``layer_ids`` (0 for AdamW)."""
    if not uses_muon(cfg):
        return 0
    kinds = {cfg.model.num_experts is not None and cfg.model.is_moe_layer(i): i for i in layer_ids}
    shapes = [s for i in kinds.values() for s in block_matrix_shapes(cfg.model, i)]
    return ns_dtype_bytes(cfg) * max((ns_workspace_elements(s) for s in shapes), default=0)


def muon_lines(cfg: Config, workspace_bytes: float, stages: Sequence[Any] = ()) -> list[str]:
    """The plan's Muon lines: what the state counts, the NS workspace and, given the plan's ``stages``, the bytes
    Muon's gathers and scatters send per step (``muon_traffic``; none for AdamW)."""
    if not uses_muon(cfg):
        return []
    ns_dtype = cfg.optimizer.muon_ns_dtype
    lines = [f"optimizer: muon; state one fp32 moment per Muon-trained element (AdamW's two for the rest); NS "
             f"workspace of the largest matrix {workspace_bytes / 2**20:.2f} MiB (2mn + 2m^2 {ns_dtype}, after the "
             "backward)"]
    if stages:
        sent = [st.muon_step_bytes for st in stages]
        lines.append(f"muon traffic: its owner gathers and scatters send {_size(max(sent))} per step (the busiest "
                     f"rank of the busiest stage"
                     f"{'' if len(sent) == 1 else '; per stage ' + ', '.join(_size(b) for b in sent)}), on top of "
                     f"AdamW's reduction and parameter gather (docs/optimizers.md; the ledger's send.muon)")
    return lines


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
