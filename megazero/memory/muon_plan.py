"""What ``--optimizer muon`` adds to a rank's memory: its optimizer state, and the Newton-Schulz (NS) workspace.

State. Muon keeps one fp32 moment per parameter where AdamW keeps two, so a store built for it would hold
``4 x moments`` bytes per parameter, plus the fp32 master copy in mixed precision (K = 4 + 4 x moments):

    AdamW           K = 12 mixed precision, 8 fp32       (two moments)
    Muon, 1 moment  K = 8 + 4 x (the AdamW-trained share: embeddings, head, norms, biases) mixed, 4 + ... fp32

so at ZeRO 1 in the ZeRO paper's mixed precision (2-byte weights and gradients) a parameter costs 4 + 12 / N
bytes under AdamW and, for the Muon-trained matrices, 4 + 8 / N. What the code allocates today is AdamW's store
whole (``optimizer/muon_shards.py``: Muon's momentum in ``exp_avg``, the Muon elements' ``exp_avg_sq`` kept at
zero), so ``MUON_MOMENTS_ALLOCATED`` is 2 and the planner charges AdamW's K for Muon too; the planner's test
measures the store (``tests/memory/test_muon_memory.py``), so a store that drops the second moment fails it
until this constant follows.

Workspace. ``optimizer.muon.orthogonalise`` on an (m, n) matrix with m <= n (a tall one is transposed) holds at
its peak the iterate X and the next one (m n each) with A = X X^T and B = bA + cA^2 (m^2 each):
2 m n + 2 m^2 elements of the NS dtype (fp32), its result included (measured op by op in that test). NS runs on
the matrix's owner after the backward has freed the activations, one matrix at a time, so a stage's figure is
the workspace of its largest Muon matrix: the rank that owns that matrix needs it (``ns_workspace_bytes``).
Not counted: the step's gathered directions and NS outputs (``muon_shards``), which the communication formula
in docs/optimizers.md sizes.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..config import Config, ModelConfig
from ..model.transformer import TPContext, TransformerBlock
from ..optimizer.muon import matrices_of, matrix_shape, takes_muon

MUON_MOMENTS_ALLOCATED = 2  # exp_avg (the momentum) and exp_avg_sq (zero for Muon's elements): AdamW's store
NS_DTYPE_BYTES = 4  # NS runs in fp32 (MuonHyper.ns_dtype)


def uses_muon(cfg: Config) -> bool:
    return cfg.optimizer.optimizer == "muon"


def optimizer_state_bytes(k_adamw: int, cfg: Config) -> int:
    """K, the optimizer-state bytes per parameter: AdamW's ``k_adamw`` (master + 2 moments), or Muon's store
    (master + ``MUON_MOMENTS_ALLOCATED`` moments, which is AdamW's K while both moments are allocated)."""
    if not uses_muon(cfg):
        return k_adamw
    master = k_adamw - 8  # 4 in mixed precision, 0 in fp32 (the parameters are the master copy)
    return master + 4 * MUON_MOMENTS_ALLOCATED


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


def ns_workspace_bytes(cfg: Config, layer_ids: list[int]) -> int:
    """Bytes of the NS workspace of the largest Muon matrix in blocks ``layer_ids`` (0 for AdamW)."""
    if not uses_muon(cfg):
        return 0
    kinds = {cfg.model.num_experts is not None and cfg.model.is_moe_layer(i): i for i in layer_ids}
    shapes = [s for i in kinds.values() for s in block_matrix_shapes(cfg.model, i)]
    return NS_DTYPE_BYTES * max((ns_workspace_elements(s) for s in shapes), default=0)


def muon_lines(cfg: Config, workspace_bytes: float) -> list[str]:
    """The plan's Muon line: what the state counts and the NS workspace (none for AdamW)."""
    if not uses_muon(cfg):
        return []
    return [f"optimizer: muon; state as allocated ({MUON_MOMENTS_ALLOCATED} fp32 moments per parameter, the "
            f"Muon elements' second at zero); NS workspace of the largest matrix {workspace_bytes / 2**20:.2f} MiB "
            f"(2mn + 2m^2 fp32, after the backward)"]
