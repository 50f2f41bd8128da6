"""This rank's experts as one grouped GEMM per projection over rows sorted by local expert.

Legend: N rows (token copies routed here), L local experts (E / ep), H hidden, F expert FFN width
(F / etp on this rank). Weights are stored [L, in, out] so ``torch._grouped_mm(x_NH, w_LHF, offs)``
multiplies rows offs[l-1]:offs[l] by expert l. Where the grouped GEMM cannot run (fp64, strides that
are not multiples of 16 bytes, a dtype the device lacks) the same product is a loop over experts.

Expert-tensor parallelism (etp > 1) splits F: each etp rank gathers the rows of every etp rank (they
hold the same experts), computes its column slice of fc1/gate and the partial sum of fc2 over its
rows of F, and the partial outputs are reduce-scattered back to the ranks that sent the rows. The
fc2 bias, whole on every etp rank, is added once after that sum; its gradient sums over etp.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel import collectives as C
from ..tensor_parallel.layers import scaled_init_std, set_spec
from .comm import all_gather_uneven_rows, reduce_scatter_uneven_rows, sum_grad_over
from .context import ExpertContext

_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands (dtype, device, 16-byte row strides; Hopper on CUDA)."""
    aligned = all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, w))
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return aligned and x.dtype in _GROUPED_DTYPES.get(x.device.type, ())


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the grouped GEMM's backward refuses stride 0
    (the gradient of a ``.sum()`` is an expanded scalar)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


Counts = list[int] | torch.Tensor  # rows per local expert: a device tensor needs no device-to-host read


def counts_on(counts: Counts, device: torch.device) -> torch.Tensor:
    """``counts`` as an int64 tensor on ``device`` (a tensor already there is returned as is)."""
    return counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, dtype=torch.int64, device=device)


def grouped_linear(x_NI: torch.Tensor, w_LIO: torch.Tensor, counts: Counts) -> torch.Tensor:
    """Rows of ``x_NI`` (sorted by expert, ``counts[l]`` for expert l) times their expert's ``w_LIO``.

    The grouped GEMM takes its offsets on the device, so tensor counts never sync with the host (on GPU a
    read there would drain the launch queue in every MoE layer). No rows at all (no token reached this
    rank's experts) takes the loop: an empty gradient keeps its stride 0 through ``contiguous()``, which the
    grouped GEMM's backward refuses."""
    if x_NI.shape[0] and grouped_mm_supported(x_NI, w_LIO):
        offs = counts_on(counts, x_NI.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x_NI, w_LIO, offs=offs))
    sizes = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    pieces = [rows @ w for rows, w in zip(x_NI.split(sizes), w_LIO)]
    return torch.cat(pieces) if pieces else x_NI.new_empty((0, w_LIO.shape[-1]))


def expert_ids(counts: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """The local expert of each row of a block sorted by expert: [0]*counts[0] + [1]*counts[1] + ...
    ``rows`` (the total, when the caller knows it) spares the device-to-host read of the sum."""
    return torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts, output_size=rows)


class GroupedExperts(nn.Module):
    """The E / ep experts of this ep rank (llama: SwiGLU; gpt2: GELU(tanh) with biases), F split over etp."""

    def __init__(self, cfg: ModelConfig, ctx: ExpertContext, device=None, dtype=None) -> None:
        super().__init__()
        ffn, num_experts = cfg.moe_ffn_size, cfg.num_experts
        if num_experts is None or num_experts % ctx.ep or ffn % ctx.etp:
            raise ValueError(f"--num-experts ({num_experts}) must be set and divisible by --expert-model-parallel-size "
                             f"({ctx.ep}), and the expert FFN width ({ffn}) by --expert-tensor-parallel-size "
                             f"({ctx.etp}); pick divisors.")
        self.ctx, self.gated = ctx, cfg.arch == "llama"
        self.num_local = num_experts // ctx.ep
        local, h, f = self.num_local, cfg.hidden_size, ffn // ctx.etp
        where = dict(device=device, dtype=dtype)
        place = dict(expert=True, first_expert=ctx.ep_rank * local, expert_tp_rank=ctx.etp_rank)
        column = dict(split_dim=2, init_std=cfg.init_method_std, **place)

        def param(shape: tuple[int, ...], **spec) -> nn.Parameter:
            return set_spec(nn.Parameter(torch.empty(shape, **where)), **spec)

        self.fc1_weight = param((local, h, f), **column)
        self.gate_weight = param((local, h, f), **column) if self.gated else None
        self.fc2_weight = param((local, f, h), split_dim=1,
                                init_std=scaled_init_std(cfg.init_method_std, cfg.num_layers), **place)
        self.fc1_bias = None if self.gated else param((local, f), split_dim=1, **place)
        self.fc2_bias = None if self.gated else param((local, h), **place)

    def extra_repr(self) -> str:
        return f"local experts {self.num_local}, ep {self.ctx.ep}, etp {self.ctx.etp}, grouped"

    def forward(self, x_NH: torch.Tensor, counts: Counts) -> torch.Tensor:
        """``x_NH`` sorted by local expert, ``counts[l]`` rows for expert l -> each row through its expert."""
        etp_group = self.ctx.etp_group
        if self.ctx.etp == 1:
            y_NH = self._ffn(x_NH, counts)
        else:
            mine = counts_on(counts, x_NH.device).unsqueeze(0)
            every = mine.new_empty((self.ctx.etp, len(counts)))
            C.all_gather_into_tensor(every, mine, etp_group)  # [etp, L]: the rows each etp rank holds
            sizes = every.sum(1).tolist()
            gathered = all_gather_uneven_rows(x_NH, etp_group, sizes)  # [etp rank][local expert]
            ids = torch.cat([expert_ids(row) for row in every])
            order = torch.argsort(ids, stable=True)  # [local expert][etp rank]: each expert's rows contiguous
            partial = self._ffn(gathered[order], every.sum(0).tolist())
            y_NH = reduce_scatter_uneven_rows(partial[torch.argsort(order)], etp_group, sizes)
        if self.fc2_bias is not None:
            bias = sum_grad_over(self.fc2_bias, etp_group)  # whole on each etp rank, applied to its own rows
            y_NH = y_NH + bias[expert_ids(counts_on(counts, x_NH.device), x_NH.shape[0])]
        return y_NH

    def _ffn(self, x_NH: torch.Tensor, counts: Counts) -> torch.Tensor:
        """fc2(act(fc1 x)) on this etp rank's slice of F: the full output at etp 1, a partial sum otherwise."""
        h_NF = grouped_linear(x_NH, self.fc1_weight, counts)
        if self.gate_weight is not None:
            h_NF = F.silu(grouped_linear(x_NH, self.gate_weight, counts)) * h_NF
        else:
            assert self.fc1_bias is not None, "GELU experts have biases"
            h_NF = F.gelu(h_NF + self.fc1_bias[expert_ids(counts_on(counts, x_NH.device), x_NH.shape[0])],
                          approximate="tanh")
        return grouped_linear(h_NF, self.fc2_weight, counts)
