"""The single-rank dropless MoE layer reads nothing back from the device, forward and backward, and the
rotary positions every layer uses are made on the device.

On a GPU each such read (``.tolist()`` of the per-expert counts, ``bincount``'s size, a Python scalar made
a device tensor) drains the launch queue in every MoE layer of every micro-batch; the OLMoE-shaped run of
bench/RESULTS_gpu.md had 256 of them per step. A CPU cannot show a sync, so the test records, with a
``TorchFunctionMode``, every tensor function the layer calls and refuses the ones that need the host to
see device data (or copy a host scalar over) when the same result can stay on the device.
"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megazero.context_parallel.split import CPSplit
from megazero.model.transformer import TPContext
from megazero.moe.context import ExpertContext
from megazero.moe.layer import MoELayer
from megazero.tensor_parallel.layers import initialize_parameters
from tests.helpers.moe import SEED, moe_config

HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.bincount, torch.Tensor.bincount,
              torch.nonzero, torch.Tensor.nonzero, torch.Tensor.new_tensor}
SIZED_BY_DATA = {torch.repeat_interleave, torch.Tensor.repeat_interleave}  # unless given output_size


class HostReads(TorchFunctionMode):
    """Records the name of every call that would make the host wait for (or copy to) the device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        data_sized = func in SIZED_BY_DATA and isinstance(repeats, torch.Tensor) and "output_size" not in kwargs
        if func in HOST_READS or data_sized:
            self.seen.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_ep1_dropless_layer_reads_nothing_from_the_device(arch: str) -> None:
    cfg = moe_config(arch, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    layer = MoELayer(cfg, ExpertContext(), 0, dtype=torch.bfloat16)  # bf16 on CPU: the grouped GEMM path
    initialize_parameters(layer, SEED, None)
    x = torch.randn(8, 2, cfg.hidden_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    with HostReads() as reads:
        layer(x).float().square().sum().backward()
    assert reads.seen == []
    assert x.grad is not None and layer.experts.fc2_weight.grad is not None
    assert layer.experts.fc2_weight.grad.abs().sum() > 0


class Copies(TorchFunctionMode):
    """Records every ``Tensor.to`` (on a GPU, a host-made tensor's ``.to(device)`` copies and syncs)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.Tensor.to
        return func(*args, **kwargs or {})


@pytest.mark.parametrize("split", [CPSplit(1), CPSplit(2), CPSplit(4, a2a=2)], ids=["cp1", "cp2-ring", "cp4-hybrid"])
def test_positions_are_made_on_the_device_they_are_asked_for(split: CPSplit) -> None:
    meta = torch.device("meta")  # stands in for a GPU: a tensor made elsewhere would need a copy
    with Copies() as copies:
        made = split.positions(16, split.cp - 1, meta)
    assert copies.count == 0 and made.device == meta
    assert made.shape == split.positions(16, split.cp - 1).shape


def test_a_layer_asks_for_its_positions_on_its_device() -> None:
    meta = torch.device("meta")
    with Copies() as copies:
        made = TPContext().positions(16, meta)
    assert copies.count == 0 and made.device == meta and made.shape == (16,)
