"""The planner's per-stage model state holds the MTP modules and the last stage's embedding copy (issue 43).

With --mtp-num-layers D the last pipeline stage holds, after its head, D modules (enorm, hnorm, eh_proj, one
block, final_norm; ``model/mtp.py``) and, under pp > 1, a copy of the word embedding the depths embed their
shifted tokens with. Counts: the planner's dense parameters (in registration order, ZeRO 3 units included) and
expert weights per stage equal the built chunks' parameters, at pp 1 and both stages of pp 2, a dense and an MoE
MTP block. Bytes: the planner's params, grads and optimizer bytes per rank within 2% (as
``test_model_state.py``) of the peaks measured over two real steps (``step_meter``), at pp 2 (dense and MoE
MTP, ZeRO 0, 1 and 2, two depths), tp 2 with SP at pp 2 (ZeRO 1) and ZeRO 3 at pp 1. Before the MTP modules
and the embedding copy were planned, the last stage of the first layout was planned at 49% of its parameters
(48,224 of 98,560).

Gradient order: on a last stage the copy's bucket gets its gradient after the MTP parameters' buckets (the
depths' backward runs first), which the planner's bucket order follows (checked against gradient hooks). Not
covered: ZeRO 2 reducing in flight (m = 1), where a bucket holding the last MTP parameters and the head is
alive from before the copy's gradient to after it (2.5% under in the first layout at m = 1), and ZeRO 3 under
pp > 1, whose last-stage replay already misses some gathered or in-flight bytes without MTP.
"""
from __future__ import annotations

import pytest
import torch

from megazero.config import Config, ModelConfig
from megazero.data_parallel.layout import plan_buckets
from megazero.data_parallel.zero3 import plan_units
from megazero.memory import PlanSpec, plan_memory
from megazero.memory.experts import expert_numels
from megazero.memory.grads import unit_buckets
from megazero.memory.mtp_plan import embedding_copy_in_gradient_order
from megazero.memory.params import chunk_param_numels, chunk_param_units
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.pipeline.partition import chunk_layer_ranges
from megazero.run_plan import RunPlan
from megazero.tensor_parallel.layers import initialize_parameters, spec_of
from tests.helpers.dist import spawn
from tests.helpers.step_meter import StepStateMeter, run_metered

DENSE = dict(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             seq_length=16, vocab_size=1000, mtp_num_layers=1)
MOE = dict(DENSE, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=["[0,1]"],
           moe_shared_expert_intermediate_size=16)  # the last layer is MoE, so the MTP block is too
MODELS = {"dense": DENSE, "moe": MOE, "moe_d2": dict(MOE, num_layers=4, moe_layer_freq=["[0,1,0,1]"],
                                                     mtp_num_layers=2)}


def _stage_chunks(cfg: ModelConfig, pp: int, stage: int) -> list[GPTModel]:
    """Stage ``stage``'s chunk as ``build_chunks`` builds it (shapes only, on the meta device)."""
    (layers,) = chunk_layer_ranges(cfg.num_layers, pp)[stage]
    with torch.device("meta"):
        return [GPTModel(cfg, TPContext(), layer_ids=layers, pre_process=stage == 0, post_process=stage == pp - 1)]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("pp", [1, 2])
def test_stage_parameters_equal_the_built_chunks(name, pp):
    cfg = Config.from_flat({**MODELS[name], "pipeline_model_parallel_size": pp, "micro_batch_size": 1,
                            "global_batch_size": pp, "device": "cpu"})
    plan = plan_memory(PlanSpec.for_world(cfg, pp, "cpu"))
    m = cfg.model
    for stage in range(pp):
        (chunk,) = _stage_chunks(m, pp, stage)
        (layers,) = chunk_layer_ranges(m.num_layers, pp)[stage]
        pre, post = stage == 0, stage == pp - 1
        dense = [p for p in chunk.parameters() if not spec_of(p).expert]
        experts = [p.numel() for p in chunk.parameters() if spec_of(p).expert]
        assert chunk_param_numels(m, 1, len(layers), pre, post, layers.start) == [p.numel() for p in dense]
        st = plan.stages[stage]
        assert st.params_on_rank == sum(p.numel() for p in dense), (name, pp, stage)
        assert st.experts.params_on_rank == sum(experts), (name, pp, stage)
        if m.num_experts is not None:
            moe_blocks = sum(m.is_moe_layer(i) for i in layers) + (m.mtp_depth if post else 0)
            assert experts == expert_numels(m, 1, 1) * moe_blocks
        _check_units(m, chunk, dense, len(layers), pre, post, layers.start)


def _check_units(cfg: ModelConfig, chunk: GPTModel, dense: list, blocks: int, pre: bool, post: bool,
                 first: int) -> None:
    """ZeRO 3's units (``plan_units``: the MTP blocks after the chunk's own) as the planner labels them."""
    for per_unit in (1, 2):
        units = plan_units(chunk, per_unit)
        unit_of = {p: 0 for u in units if u.root for p in u.params}
        unit_of.update({p: i + 1 for i, u in enumerate(u for u in units if not u.root) for p in u.params})
        assert chunk_param_units(cfg, blocks, pre, post, per_unit, first) == [unit_of[p] for p in dense]


@pytest.mark.parametrize("name", ["dense", "moe_d2", "tied"])
def test_the_embedding_copy_bucket_takes_its_gradient_order(name):
    """The planner's bucket order on a last stage (``mtp_plan.embedding_copy_in_gradient_order``) is the order the
    buckets' first gradients arrive in a real backward (gradient hooks; the buffers' cut, ``plan_buckets``)."""
    cfg = ModelConfig(**(dict(DENSE, untie_embeddings_and_output_weights=False) if name == "tied" else MODELS[name]))
    layers = range(cfg.num_layers // 2, cfg.num_layers)
    torch.manual_seed(0)
    chunk = GPTModel(cfg, TPContext(), layer_ids=layers, pre_process=False, post_process=True)
    initialize_parameters(chunk, 1, None)
    dense = [p for p in chunk.parameters() if not spec_of(p).expert]
    buckets, _ = plan_buckets(dense[::-1], 3000, 2, 0)
    first_grad: dict[int, int] = {}

    def arrived_in(index: int) -> None:
        first_grad.setdefault(index, len(first_grad))

    for b in buckets:
        for p in b.params:
            p.register_post_accumulate_grad_hook(lambda p, index=b.index: arrived_in(index))
    chunk(torch.randn(cfg.seq_length, 2, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
          ).backward()
    arrived = [(0, b.numel) for b in sorted(buckets, key=lambda b: first_grad[b.index])]
    numels = chunk_param_numels(cfg, 1, len(layers), False, True, layers.start)
    units = [0] * len(numels)
    planned = embedding_copy_in_gradient_order(cfg, unit_buckets(numels, units, 3000, 2, True), numels, units, 3000, 2)
    assert planned == arrived
    assert arrived[0] != (0, buckets[-1].numel)  # the copy's gradient is not the first (MTP's come before it)


LAYOUTS = [  # (world, tp, pp, zero, precision, main grads, model)
    (2, 1, 2, 0, "fp32", "fp32", "dense"),
    (4, 1, 2, 1, "bf16", "fp32", "moe"),  # dp 2: the dense and expert state shard over 2
    (4, 2, 2, 1, "fp32", "fp32", "moe"),  # tp 2 (SP): the MTP norms and eh_proj replicated, the block split
    (4, 1, 2, 2, "fp32", "fp32", "moe_d2"),  # two MTP depths, ZeRO 2 (m 2: full-size grads accumulate)
    (2, 1, 1, 3, "bf16", "fp32", "dense"),  # ZeRO 3: the MTP block is a unit, its norms and eh_proj the root's
]


def _config(tp: int, pp: int, zero: int, precision: str, grads: str, model: str) -> Config:
    flat = {**MODELS[model], "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "zero": zero,
            "sequence_parallel": tp > 1, "bf16": precision == "bf16", "main_grads_dtype": grads,
            "micro_batch_size": 2, "global_batch_size": 8, "device": "cpu", "bucket_size": 3000}
    return Config.from_flat(flat)


class BucketStateMeter(StepStateMeter):
    """``StepStateMeter`` counting only the reduce-scatters of gradient buckets: under sequence parallelism the
    layers' own reduce-scatters write activations, not model state."""

    def _reduce_scatter(self, out, inp, *args, **kwargs):
        held = self.held_grads()
        bucket = inp.untyped_storage().data_ptr() in held and out.untyped_storage().data_ptr() not in held
        self.sample(out.untyped_storage().nbytes() if bucket else 0)
        return self._original_rs(out, inp, *args, **kwargs)


def _measure(pstate, layout: tuple) -> dict:
    _, record = run_metered(pstate, _config(*layout[1:]), meter_type=BucketStateMeter)
    return {**record, "pp_rank": pstate.pp_rank, "rank": pstate.rank}


def test_mtp_model_state_matches_measured_records():
    """Within 2% per component of the peak measured during two real steps, on every rank of every layout."""
    bad, seen = [], []
    for layout in LAYOUTS:
        world, tp, pp = layout[:3]
        cfg = _config(*layout[1:])
        plan = plan_memory(PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, world), device="cpu"))
        for rec in spawn(_measure, world, layout, tp=tp, pp=pp):
            stage = plan.stages[rec["pp_rank"]]
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                predicted, measured = getattr(stage, key), rec[key]
                seen.append(f"{layout} rank {rec['rank']} {key}: predicted {predicted:.0f}, measured {measured}")
                if abs(predicted - measured) > 0.02 * measured:
                    bad.append(seen[-1])
    print("\n".join(seen))
    assert not bad, "\n".join(bad)
