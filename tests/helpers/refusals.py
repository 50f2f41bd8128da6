"""The one line pretrain_gpt.py prints for a refused command, found in-process: every check of a run before its
process groups is ``prepare_run`` (which ``run`` calls first), so no rank is needed to see it."""
from __future__ import annotations


def refusal_line(argv: list[str], nproc: int) -> str:
    """What ``pretrain_gpt.py *argv`` at ``nproc`` ranks prints after refusing it; fails if it is not refused."""
    import pretrain_gpt
    from megazero.training.run import prepare_run

    try:
        cfg, ns = pretrain_gpt._parse(argv)
        pretrain_gpt._check_dry_run_flags(ns)
        prepare_run(cfg, nproc, None, lambda _: None)
    except pretrain_gpt.UsageError as err:
        return str(err)
    except ValueError as err:  # ConfigError too: what main() prints after "pretrain_gpt.py: error: "
        return f"pretrain_gpt.py: error: {err}"
    raise AssertionError(f"{argv} at {nproc} rank(s) was not refused before the process groups")
