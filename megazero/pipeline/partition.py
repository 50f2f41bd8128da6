"""Which layers each pipeline rank holds, and building those model chunks.

With ``pp`` stages and ``vp`` model chunks per rank (virtual stages, for the
interleaved schedule) the model is cut into ``pp * vp`` equal runs of layers.
Virtual stage ``c * pp + r`` is chunk ``c`` of pipeline rank ``r`` (Megatron's
round-robin assignment), so with vp = 2, pp = 2 and 8 layers:

    rank 0: chunk 0 = layers 0-1, chunk 1 = layers 4-5
    rank 1: chunk 0 = layers 2-3, chunk 1 = layers 6-7

The embedding lives on the very first virtual stage, the final norm, head and
loss on the very last. Blocks are keyed by global layer index, so the seeded
initialisation does not depend on the split.
"""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..config import Config, ConfigError
from ..context_parallel import CPContext
from ..model.chunk import routers_of
from ..model.gpt import GPTModel
from ..model.transformer import TPContext
from ..moe.context import Dispatcher, ExpertContext
from ..parallel.state import ParallelState
from ..run_plan import RunPlan
from ..tensor_parallel.layers import initialize_parameters, materialize, spec_of
from ..tensor_parallel.random import DropoutRNG


def chunk_layer_ranges(num_layers: int, pp: int, vp: int = 1) -> list[list[range]]:
    """``ranges[r][c]``: the global layer indices of chunk ``c`` on pipeline rank ``r``."""
    if pp < 1 or vp < 1 or num_layers % (pp * vp) != 0:
        raise ConfigError(f"--num-layers ({num_layers}) must be divisible by --pp ({pp}) x "
                          f"--virtual-pipeline-size ({vp}); change one of them.")
    per_chunk = num_layers // (pp * vp)
    return [[range((c * pp + r) * per_chunk, (c * pp + r + 1) * per_chunk) for c in range(vp)]
            for r in range(pp)]


def dropout_rng(cfg: Config, pstate: ParallelState) -> DropoutRNG:
    """This rank's dropout streams (one pair per global layer), seeded from --seed: a run builds them once
    and hands the same object to the model, the checkpoint saver and the loader."""
    return DropoutRNG(cfg.training.seed, pstate.tp_rank, pstate.device)


def cp_context(plan: RunPlan, pstate: ParallelState) -> CPContext:
    """This rank's place in its context-parallel group, for the attention core and the token split."""
    return CPContext(group=pstate.cp_group, rank=pstate.cp_rank, comm_type=plan.cp_comm_type, split=plan.cp_split,
                     a2a_group=pstate.cp_a2a_group, ring_group=pstate.cp_ring_group)


def build_chunks(cfg: Config, plan: RunPlan, pstate: ParallelState,
                 rng: DropoutRNG | None = None) -> list[nn.Module]:
    """This rank's ``plan.virtual_stages`` model chunks, initialised as slices of the seeded full model.

    Built on the meta device, then given storage in ``plan.compute_dtype`` on the run's device and
    initialised (drawn in fp32, cast), so start-up allocates and draws this rank's parameters only.
    The plan gives the padded vocabulary and sequence parallelism; ``rng`` the dropout streams
    (None: fresh ones from ``dropout_rng``, for a model nobody checkpoints).

    With tied embeddings (or MTP, whose last stage embeds too) split over stages, both copies of the word embedding are
    marked so the optimizer sums their gradients over the embedding group: the
    last stage's copy has ``ParamSpec.tied_role`` "embedding_copy" (GPTModel marks
    it), the first stage's original "embedding".
    """
    vp = plan.virtual_stages
    rng = dropout_rng(cfg, pstate) if rng is None else rng
    dispatcher = cast(Dispatcher, cfg.parallel.moe_token_dispatcher_type)  # one of those: the config checked it
    experts = ExpertContext.of(pstate, plan.sequence_parallel, dispatcher)
    ctx = TPContext(group=pstate.tp_group, sequence_parallel=plan.sequence_parallel, rng=rng,
                    cp=cp_context(plan, pstate), experts=experts)
    ranges = chunk_layer_ranges(cfg.model.num_layers, pstate.pp, vp)[pstate.pp_rank]
    chunks: list[nn.Module] = []
    for c, layer_ids in enumerate(ranges):
        with torch.device("meta"):  # shapes only: no default initialiser runs, nothing is allocated
            model = GPTModel(cfg.model, ctx, padded_vocab=plan.padded_vocab_size, layer_ids=layer_ids,
                             pre_process=pstate.is_first_stage and c == 0,
                             post_process=pstate.is_last_stage and c == vp - 1,
                             ce_chunk_size=cfg.training.cross_entropy_chunk_size)
        if model.pre_process and pstate.pp > 1 and (cfg.model.tied_embeddings or cfg.model.mtp_depth > 0):
            spec_of(model.embedding.word.weight).tied_role = "embedding"
        materialize(model, pstate.device, plan.compute_dtype)
        initialize_parameters(model, cfg.training.seed, pstate.tp_group)
        for router in routers_of(model):  # buffers: materialize left the expert bias uninitialised
            router.reset_expert_bias()
        chunks.append(model)
    return chunks
