"""The memory planner: per-rank bytes of a model and a parallel layout, and a layout search.

- ``params``: closed-form parameter counts and model-state bytes (ZeRO stages, precision);
- ``grads``: gradient bytes at the optimizer's high-water mark (ZeRO 2's full-size buckets);
- ``zero3``: ZeRO 3's model state at its high-water mark (gathered units, bucket gradients);
- ``activations``: bytes saved for backward, per term, calibrated to our blocks;
- ``plan``: both combined per pipeline stage (``plan_memory``, ``format_plan``);
- ``offload``: device / host / disk bytes with ``--offload-optimizer``/``--offload-params``, and an
  assumption-based cost per step;
- ``documents``: what a plan assumes under ``--reset-attention-mask`` (documents of ``--plan-document-length``):
  per-document attention bytes, the attended share of the attention work;
- ``search``: feasible layouts on a cluster ranked by a step-time model (offload variants optional);
- ``recompute_choice``: ``--recompute auto``, the cheapest recompute whose planned peak fits the budget, and
  the plans of a run (``plan_for_run``) and of the planner (``plan_for_cluster``), which may choose it.
"""
from .activations import ActivationSpec, chunk_activation_bytes, in_flight_micro_batches, layer_terms
from .grads import GradBytes, bucket_numels, grad_bytes
from .params import StateBytes, chunk_params, model_state_bytes, num_parameters
from .offload import OffloadBytes, OffloadHardware, offload_bytes, offload_seconds
from .assumed import planned_world, with_vocabulary
from .plan import GIB, PLANNED_PATH, MemoryPlan, PlanSpec, StagePlan, format_plan, format_rows, plan_memory
from .recompute_choice import plan_for_run
from .search import Candidate, Hardware, format_candidates, search_layouts, step_time

__all__ = ["ActivationSpec", "Candidate", "GIB", "GradBytes", "Hardware", "MemoryPlan", "OffloadBytes",
           "OffloadHardware", "PLANNED_PATH", "PlanSpec", "StagePlan", "StateBytes", "bucket_numels",
           "chunk_activation_bytes", "chunk_params", "format_candidates", "format_plan", "format_rows", "grad_bytes",
           "in_flight_micro_batches", "layer_terms", "model_state_bytes", "num_parameters", "offload_bytes",
           "offload_seconds", "plan_for_run", "plan_memory", "planned_world", "search_layouts", "step_time",
           "with_vocabulary"]
