"""Running one model across ranks: the collectives sharded layers call (group.py), the step rank 0
broadcasts to the others (step_sync.py), and the process the other ranks run (worker.py)."""

from plait.runtime.distributed.group import SINGLE, Group, init_group, partition

__all__ = ["SINGLE", "Group", "init_group", "partition"]
