"""The CP subgroups of a test world, built the way ``ParallelState`` lays them out."""
from __future__ import annotations

import torch.distributed as dist


def cp_groups(cp: int, a2a: int) -> tuple:
    """This rank's CP group, its all-to-all group and its ring (new_group is collective: all ranks, one order)."""
    rank, mine = dist.get_rank(), {}
    whole = dist.new_group(list(range(cp)))
    for name, parts in (("a2a", [list(range(i, i + a2a)) for i in range(0, cp, a2a)]),
                        ("ring", [list(range(u, cp, a2a)) for u in range(a2a)])):
        for ranks in parts:
            handle = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = handle
    return whole, mine["a2a"], mine["ring"]
