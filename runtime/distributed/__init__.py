"""Running one model across ranks: the collectives sharded layers call (group.py), the step rank 0
broadcasts to the others (step_sync.py), and the process the other ranks run (worker.py). Names import on first
use (the launcher reads worker.py's placement without torch)."""

from plait.runtime.lazy import lazy_exports

_NAMES = {"SINGLE": "group", "Group": "group", "init_group": "group", "partition": "group"}
__getattr__ = lazy_exports(__name__, _NAMES)
__all__ = list(_NAMES)
