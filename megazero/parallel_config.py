"""The parallel layout a run asks for (``--tp``, ``--pp``, ``--cp``, ``--ep``, ZeRO, offload): one config section.

Kept apart from ``config.py`` (which re-exports it) so that module stays readable; the degrees here are
checked against the world size when the run plan lays the ranks out (``run_plan.py``, ``parallel/layout.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .config_fields import Needs, check_fields, opt, require, when
from .moe_config import WITH_EXPERTS

OFFLOAD_FLAGS = ("none", "cpu", "disk")  # --offload-optimizer/--offload-params: device, host memory, files
_ON_DEVICE, _ON_DISK = OFFLOAD_FLAGS[0], OFFLOAD_FLAGS[2]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "Tensor-parallel degree (ranks per TP group, inside a node).", "--tp",
                                         at_least=1)
    pipeline_model_parallel_size: int = opt(1, "Pipeline-parallel degree (number of stages).", "--pp",
                                           at_least=1)
    context_parallel_size: int = opt(1, "Context-parallel degree: each sample's sequence is split over this many "
                                     "ranks (S/cp tokens each; attention exchanges K/V among them).", "--cp",
                                     at_least=1)
    cp_comm_type: str = opt("p2p", "Context-parallel attention: p2p (ring exchange of K/V, load-balanced split), "
                            "a2a (all-to-all from sequence to head shards, Ulysses) or a2a+p2p (all-to-all inside "
                            "groups of --cp-a2a-size ranks, ring across them).", choices=("p2p", "a2a", "a2a+p2p"),
                            applies=Needs("--cp 2 or more", ("context_parallel_size",), lambda cp: cp > 1))
    cp_a2a_size: int | None = opt(None, "--cp-comm-type a2a+p2p: ranks per all-to-all group (divides --cp; "
                                  "consecutive ranks, so inside a node).", at_least=1,
                                  applies=when("cp_comm_type", "a2a+p2p"))
    expert_model_parallel_size: int = opt(1, "Expert-parallel degree: the --num-experts experts are spread over this "
                                          "many ranks (E/ep each), borrowed from tp x cp x dp of a pipeline stage; "
                                          "tokens travel to their experts.", "--ep", at_least=1, applies=WITH_EXPERTS)
    expert_tensor_parallel_size: int | None = opt(None, "Expert-tensor-parallel degree: each expert's weights split "
                                                  "over this many ranks; None = --tp.", "--etp", at_least=1,
                                                  applies=WITH_EXPERTS)
    moe_token_dispatcher_type: str = opt("alltoall", "How tokens reach their experts over the --ep group: alltoall "
                                         "(counts first, then only the routed tokens) or allgather (every rank "
                                         "gathers all tokens; for small --ep and large top-k).",
                                         choices=("alltoall", "allgather"), applies=WITH_EXPERTS)
    zero: int = opt(0, "ZeRO stage: 0 all-reduce (DDP), 1 shard optimizer state, 2 also shard gradients, "
                    "3 also shard parameters (gathered one unit at a time).", choices=(0, 1, 2, 3))
    zero3_unit_layers: int = opt(1, "ZeRO 3: transformer blocks per gathered unit (embeddings, final norm and head "
                                 "form one more unit per chunk).", at_least=1, applies=when("zero", 3))
    zero3_prefetch: int = opt(1, "ZeRO 3: units whose all-gather is issued ahead of the one computing (next in "
                              "forward, previous in backward); 0 = gather only when needed.",
                              at_least=0, applies=when("zero", 3))
    reshard_after_forward: bool = opt(True, "ZeRO 3: free a unit's gathered parameters after its forward and gather "
                                      "them again for its backward (3x parameter traffic); --no-reshard-after-"
                                      "forward keeps them from forward to backward (2x, more memory).",
                                      applies=when("zero", 3))
    sequence_parallel: bool = opt(False, "Shard LayerNorm/dropout regions along the sequence across TP ranks.")
    allow_tp_across_nodes: bool = opt(False, "Accept TP groups that span nodes (all-reduces cross the network).")
    pipeline_schedule: str | None = opt(None, "Pipeline schedule; None = 1f1b, or interleaved when virtual "
                                        "stages are given ('interleaved' needs them).",
                                        choices=("gpipe", "1f1b", "interleaved"),
                                        applies=Needs("--pp 2 or more", ("pipeline_model_parallel_size",),
                                                      lambda pp: pp > 1))
    num_layers_per_virtual_pipeline_stage: int | None = opt(
        None, "Layers per virtual stage (model chunk) for the interleaved schedule; None = one chunk per rank.",
        at_least=1)
    bucket_size: int = opt(10_000_000, "Elements per gradient bucket: communication is launched per bucket "
                           "as it fills during backward (larger = fewer, bigger collectives).", at_least=1)
    overlap_param_gather: bool = opt(False, "ZeRO 1/2: all-gather updated weights asynchronously and wait for "
                                     "each bucket only in the next forward that uses it (ZeRO 3 always gathers "
                                     "per unit in forward, overlapped by --zero3-prefetch).",
                                     applies=when("zero", 1, 2))
    reduce_every_micro_batch: bool = opt(False, "ZeRO 2: reduce-scatter each micro-batch's gradients into this rank's "
                                         "shard as its buckets fill (DeepSpeed's way), so no full-size gradient "
                                         "outlives a bucket under accumulation (2 + 14/N bytes per parameter at any "
                                         "micro-batch count), at m reduce-scatters per step instead of one.",
                                         applies=when("zero", 2))
    virtual_pipeline_size: int | None = opt(
        None, "Model chunks per pipeline rank (alternative to --num-layers-per-virtual-pipeline-stage); "
        "None or 1 = one chunk.", at_least=1)
    offload_optimizer: str = opt("none", "Where the fp32 master weights and Adam moments live: none (the device), "
                                 "cpu (host memory; the step runs there) or disk (per-rank files under "
                                 "--offload-path, streamed bucket by bucket).", choices=OFFLOAD_FLAGS)
    offload_params: str = opt("none", "ZeRO 3: where each rank's parameter shards live between uses: none (the "
                              "device), cpu (host memory) or disk (files under --offload-path); needs "
                              "--offload-optimizer cpu or disk.", choices=OFFLOAD_FLAGS)
    offload_path: str | None = opt(None, "--offload-optimizer/--offload-params disk: folder for the per-rank files "
                                   "(a fast local disk; each rank writes rank<N>/ there).",
                                   applies=Needs("--offload-optimizer or --offload-params disk",
                                                 ("offload_optimizer", "offload_params"),
                                                 lambda optimizer, params: "disk" in (optimizer, params)))
    offload_buffers: int = opt(2, "--offload-optimizer disk: host buffers (one piece of state each) the step "
                               "streams through; >= 2 so the next piece is read while one is updated.", at_least=2,
                               applies=when("offload_optimizer", "disk"))
    offload_buffer_size: int = opt(2_000_000, "--offload-optimizer disk: shard elements per host buffer (12 bytes "
                                   "each: master + moments); a larger bucket shard streams through in pieces.",
                                   at_least=64, applies=when("offload_optimizer", "disk"))
    distributed_timeout_minutes: float = opt(10.0, "Minutes a collective may wait for a peer before the run fails "
                                             "(a dead or stuck rank then ends the job; fractions allowed).",
                                             above=0)

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.offload_params == _ON_DEVICE or (self.zero == 3 and self.offload_optimizer != _ON_DEVICE),
                 f"--offload-params {self.offload_params} needs --zero 3 (got {self.zero}) and --offload-optimizer "
                 f"cpu or disk (got {self.offload_optimizer}); add them or drop --offload-params.")
        disk = _ON_DISK in (self.offload_optimizer, self.offload_params)
        which = "--offload-optimizer" if self.offload_optimizer == _ON_DISK else "--offload-params"
        require(not disk or bool(self.offload_path), f"{which} disk needs --offload-path DIR (a folder for the "
                                                      f"per-rank state files).")
        require(self.cp_comm_type != "a2a+p2p" or (self.cp_a2a_size is not None and self.cp % self.cp_a2a_size == 0
                                                   and 1 < self.cp_a2a_size < self.cp),
                f"--cp-comm-type a2a+p2p needs --cp-a2a-size U with 1 < U < --cp ({self.cp}) and U dividing --cp "
                f"(got {self.cp_a2a_size}); use --cp-comm-type p2p or a2a for the pure forms.")

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def cp_a2a(self) -> int:
        """U: ranks per all-to-all group (1 = ring only, cp = all-to-all only)."""
        if self.cp_comm_type == "p2p":
            return 1
        if self.cp_comm_type == "a2a":
            return self.cp
        return self.cp_a2a_size or 1

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        """--etp, or --tp when not given (Megatron's default)."""
        return self.tp if self.expert_tensor_parallel_size is None else self.expert_tensor_parallel_size
