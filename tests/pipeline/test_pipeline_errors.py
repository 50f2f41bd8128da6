"""Bad pipeline input fails clearly, on every rank, before anything can hang.

Flag errors are raised by ``validate`` (pure arithmetic, before any process group
exists), so every rank raises the same ConfigError; a rank launched with a different
activation shape is caught by the stages' shape all-gather at build time, on all ranks.
"""
from __future__ import annotations

from megazero.config import ConfigError
from megazero.pipeline.partition import chunk_layer_ranges
from megazero.run_plan import RunPlan
from megazero.training.parallelize import build_model_chunks
from megazero.training.run import validate
from tests.helpers.dist import spawn
from tests.helpers.pipeline_harness import make_cfg

# name -> (config, world size, words the message must contain)
BAD = {
    "pp > layers": (make_cfg("gpt2", pp=8, layers=4), 8, "--pp (8) exceeds --num-layers (4)"),
    "layers % pp": (make_cfg("gpt2", pp=3, layers=4), 3, "--num-layers (4) must be divisible by --pp (3)"),
    "layers % (pp*vp)": (make_cfg("gpt2", pp=2, vp=3, layers=4), 2, "--virtual-pipeline-size (3)"),
    "interleaved m % pp": (make_cfg("gpt2", pp=4, vp=2, layers=8, gbs=12), 4,
                           "micro-batches per step (6 = --global-batch-size 12"),
    "interleaved without chunks": (make_cfg("gpt2", pp=2, schedule="interleaved"), 2,
                                   "needs --virtual-pipeline"),
    "chunks without interleaved": (make_cfg("gpt2", pp=2, schedule="1f1b", vp=2), 2, "one chunk per rank"),
    "both virtual flags disagree": (make_cfg("gpt2", pp=2, vp=2, per_vstage=1, layers=8), 2, "disagrees"),
    "interleaved with pp=1": (make_cfg("gpt2", pp=1, vp=2), 1, "needs --pp >= 2"),
}


def test_partition_layout():
    assert chunk_layer_ranges(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert chunk_layer_ranges(4, 4) == [[range(i, i + 1)] for i in range(4)]


def test_bad_flags_fail_in_validation_with_named_flags():
    for name, (cfg, world, words) in BAD.items():
        try:
            validate(cfg, world)
        except ConfigError as err:
            assert words in str(err), f"{name}: message {str(err)!r} lacks {words!r}"
        else:
            raise AssertionError(f"{name}: validate accepted a bad pipeline config")


def bad_input_on_every_rank(pstate) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, (cfg, world, _) in BAD.items():
        try:
            validate(cfg, world)
            out[name] = None
        except ConfigError as err:
            out[name] = str(err)
    # this rank was launched with its own --seq-length: the stages must not start exchanging
    cfg = make_cfg("gpt2", pp=2, seq=16 if pstate.pp_rank == 0 else 32)
    try:
        build_model_chunks(cfg, RunPlan.resolve(cfg, pstate.layout.world_size), pstate)
        out["stage shapes"] = None
    except ConfigError as err:
        out["stage shapes"] = str(err)
    return out


def test_every_rank_fails_without_hanging():
    results = spawn(bad_input_on_every_rank, 2, pp=2, timeout=300)
    for rank, out in enumerate(results):
        missing = [name for name, msg in out.items() if msg is None]
        assert not missing, f"rank {rank} accepted: {missing}"
        assert "stages disagree on the activation shape" in out["stage shapes"], out["stage shapes"]
        assert "[16, 2, 32]" in out["stage shapes"] and "[32, 2, 32]" in out["stage shapes"], out["stage shapes"]
