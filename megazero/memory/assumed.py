"""What a plan assumes of a run it has not started: the device kind, the world, the vocabulary.

A plan is made before any data is read or rank launched (``--dry-run``, ``tools/plan_memory.py``, the
recompute choice), so these fill in what a run would only learn when it starts.
"""
from __future__ import annotations

from ..config import Config


def planned_device(cfg: Config) -> str:
    """The device kind a plan assumes: cpu only when the run is on the CPU."""
    return "cpu" if cfg.training.device == "cpu" else "cuda"


def with_vocabulary(cfg: Config) -> Config:
    """``cfg`` with --vocab-size filled in where a run would know it: its --tokenizer-model's, or the default
    corpus's (no --data-path; known without building it). A run refuses --data-path without a tokenizer."""
    if cfg.model.vocab_size is not None or (cfg.data.data_path and not cfg.data.tokenizer_model):
        return cfg
    if cfg.data.tokenizer_model:
        from ..data.tokenizer import load_tokenizer

        return cfg.updated(vocab_size=load_tokenizer(cfg.data.tokenizer_model).vocab_size)
    from ..data.corpus import DEFAULT_VOCAB_SIZE

    return cfg.updated(vocab_size=DEFAULT_VOCAB_SIZE)


def planned_world(cfg: Config, dp: int) -> int:
    """Ranks of ``cfg``'s tp x cp x pp with ``dp`` data-parallel ranks: a world the planner only considers."""
    return cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp * dp

