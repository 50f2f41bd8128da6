"""Which saved random generators a resumed run continues: declared per kind, decided from the layouts.

A rank's RNG file holds three kinds of generator (``save.rng_state``). Each kind's state after a
step depends on some layout axes and not on others; that is a fact about how it is seeded and how
much it draws, declared once here (``KINDS``). On resume, a kind continues from the checkpoint when
none of the axes it depends on changed, and starts again from --seed otherwise, with one line
saying which kinds and which change (``describe``).

The axes are the rank grid's (tp, cp, pp, dp), the virtual stages, and whether sequence parallelism
is in effect (tp > 1 with --sequence-parallel): it moves hidden dropout from the shared streams to
the per-TP-rank ones. Not the ZeRO stage nor offload: they move optimizer state, not random draws.
Nothing depends on cp: hidden-dropout masks are drawn for the whole sequence and sliced
(``model.transformer.hidden_dropout``), and attention dropout is refused with cp > 1.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from ..parallel.layout import Layout

AXES = ("tp", "cp", "pp", "dp", "virtual_stages", "sequence_parallel")


@dataclass(frozen=True)
class GeneratorKind:
    """One kind of saved generator: the RNG-file keys that hold it and the layout axes its state depends on."""

    name: str  # as the resume line names it
    keys: tuple[str, ...]  # fnmatch patterns over the RNG file's keys
    depends_on: frozenset[str]

    def holds(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.keys)


# Seeded with the pipeline rank (``seed_everything``); dropout draws from its own streams, so a
# step draws nothing from it.
DEFAULT = GeneratorKind("the default generator", ("cpu", "cuda"), frozenset({"pp"}))
# One per global layer, the same on every TP and CP rank; which layers a rank holds follows pp and
# the virtual stages, and each DP rank draws its global/dp samples a step.
SHARED = GeneratorKind("the shared dropout streams", ("dropout/*.shared",),
                       frozenset({"pp", "virtual_stages", "dp", "sequence_parallel"}))
# As SHARED, and seeded by TP rank, drawing that rank's heads / sequence shard: no map to another tp.
PER_TP_RANK = GeneratorKind("the per-TP-rank dropout streams", ("dropout/*.tp",),
                            frozenset({"tp", "pp", "virtual_stages", "dp", "sequence_parallel"}))
KINDS = (DEFAULT, SHARED, PER_TP_RANK)


def rng_axes(layout: dict[str, Any], sequence_parallel: bool) -> dict[str, Any]:
    """A recorded layout (``RunPlan.layout_record``) as the axes above; checkpoints from before CP were cp 1."""
    axes = {axis: layout.get(axis, 1 if axis == "cp" else None) for axis in AXES[:-1]}
    axes["sequence_parallel"] = bool(sequence_parallel) and layout["tp"] > 1
    return axes


def changed_axes(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every axis whose value differs, with (saved, now)."""
    return {axis: (saved[axis], now[axis]) for axis in AXES if saved[axis] != now[axis]}


def held_kinds(keys: list[str]) -> list[GeneratorKind]:
    """The kinds an RNG file with these keys holds (a stream never drawn from is not saved)."""
    return [kind for kind in KINDS if any(map(kind.holds, keys))]


def reseeded(held: list[GeneratorKind], changed: dict[str, tuple[Any, Any]]) -> list[GeneratorKind]:
    """The held kinds whose state depends on a changed axis."""
    return [kind for kind in held if kind.depends_on & changed.keys()]


def source_rank(saved: dict[str, Any], now: Layout, rank: int) -> int:
    """The saved rank whose RNG file this rank resumes from.

    Along an unchanged axis, this rank's own coordinate. Along a changed one, the first: only kinds
    that do not depend on that axis resume, and they hold the same state at every coordinate along it.
    """
    mine = now.coords(rank)
    before = Layout(tp=saved["tp"], dp=saved["dp"], pp=saved["pp"], cp=saved["cp"])
    pick = {axis: getattr(mine, axis) if saved[axis] == getattr(now, axis) else 0 for axis in ("tp", "cp", "dp", "pp")}
    return before.rank(**pick)


def describe(held: list[GeneratorKind], reseed: list[GeneratorKind], changed: dict[str, tuple[Any, Any]]) -> str:
    """The one line a resume prints when the kinds ``reseed`` start again from --seed."""
    causes = sorted(set().union(*(kind.depends_on for kind in reseed)) & changed.keys(), key=AXES.index)
    what = ", ".join(f"{axis} {changed[axis][0]} -> {changed[axis][1]}" for axis in causes)
    kept = [kind.name for kind in held if kind not in reseed]
    resume = f"resuming {' and '.join(kept)} from the checkpoint" if kept else "nothing else was saved"
    return (f"megazero: {what} changed: re-seeding {' and '.join(k.name for k in reseed)} from --seed "
            f"(their state depends on it); {resume}.")
