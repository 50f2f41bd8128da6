"""Expert-weight memory measured during real MoE training steps, to check the planner's expert figures.

``ExpertStateMeter`` is ``step_meter.StepStateMeter`` restricted to the expert buffers
(``ParamGradBuffer.expert``): their parameters (buffer, ZeRO 3 shards and gathered buckets), gradients
(buffer or shards, full-size bucket gradients, the partial shards of their reductions in flight) and the
optimizer state of those buffers (``DeviceStore.states[i]`` lines up with ``opt.buffers[i]``). It serves runs
with fp32 main gradients, whose ``step()`` makes no fp32 copies of the shards (with bf16 main grads it could not
tell an expert shard's copy from a dense one's).
"""
from __future__ import annotations

from typing import Any

from megazero.config import Config
from megazero.optimizer.accounting import counted_parameters
from megazero.parallel.state import ParallelState
from megazero.training.parallelize import TrainingModel
from tests.helpers.step_meter import StepStateMeter, _storages, run_metered


class ExpertStateMeter(StepStateMeter):
    """Peak expert params + grads + optimizer bytes of ``model``'s optimizer over the steps run while installed."""

    def __init__(self, model: TrainingModel) -> None:
        super().__init__(model)
        opt = model.optimizer
        self.experts = [buf for buf in opt.buffers if buf.expert]
        assert self.experts, "the model has no expert weights"
        states = [state for buf, state in zip(opt.buffers, opt.store.states) if buf.expert]
        self.optimizer = sum(_storages(t for state in states for t in state.tensors()).values())

    def _adamw(self, master, grad, *args, **kwargs) -> None:
        """fp32 main grads: no copies to count (the base class would take the dense shards for copies)."""
        assert grad.dtype == master.dtype, "the expert meter serves fp32 main gradients only"
        self.sample()
        return self._original(master, grad, *args, **kwargs)

    def _reduce_scatter(self, out, inp, *args, **kwargs):
        """Only an expert bucket's reduction writes expert gradient bytes (dense buckets and SP layers reduce-scatter
        too)."""
        held = self.held_grads()
        expert = inp.untyped_storage().data_ptr() in held and out.untyped_storage().data_ptr() not in held
        self.sample(out.untyped_storage().nbytes() if expert else 0)
        return self._original_rs(out, inp, *args, **kwargs)

    def held_params(self) -> dict[int, int]:
        bufs = self.experts
        return _storages([b.param_data for b in bufs] + [b.param_shard_data for b in bufs]
                         + [k.param for b in bufs for k in b.buckets])

    def held_grads(self) -> dict[int, int]:
        bufs = self.experts
        partials = [entry.partial for entry in self.engine._inflight if entry.buf.expert and entry.partial is not None]
        return _storages([b.grad_data for b in bufs] + [b.grad_shard_data for b in bufs]
                         + [k.grad for b in bufs for k in b.buckets] + partials)


def measured_expert_state(pstate: ParallelState, cfg: Config) -> dict[str, Any]:
    """Two real training steps of ``cfg``: this rank's expert bytes at their peak, and where the rank sits."""
    counted: list[int] = []
    _, record = run_metered(pstate, cfg, steps=2, meter_type=ExpertStateMeter,
                            on_built=lambda chunks, opt: counted.append(counted_parameters(chunks, pstate)))
    return {**record, "pp_rank": pstate.pp_rank, "rank": pstate.rank, "num_parameters": counted[0]}
