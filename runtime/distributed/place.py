"""Where a runtime process stands among the ranks, and how it joins its group. No torch at import: the launcher
reads placements before any process starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankPlace:
    """Where a runtime process stands: its rank in its replica's group, the replica, where the group
    meets (host:port; empty with one rank), and the group's shape."""

    rank: int = 0
    replica: int = 0
    init_addr: str = ""
    size: int = 1  # ranks in the group (tp_size)
    expert_parallel: bool = False
    timeout: float = 300.0  # seconds a collective may wait (dist_timeout)
    one_machine: bool = True  # every rank on this machine: shared-memory collectives


def join(place: RankPlace):
    """This rank's group: the collectives of its replica (a group of one where the size is 1)."""
    from plait.runtime.distributed.group import init_group

    return init_group(place.rank, place.size, place.init_addr, place.expert_parallel, place.timeout,
                      one_machine=place.one_machine)
