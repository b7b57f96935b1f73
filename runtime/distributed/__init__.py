"""Running one model across ranks: a rank's place and the collectives sharded layers call (group.py), over gloo
or, on one machine, shared memory (shm.py). Names import on first use. The step rank 0 broadcasts is
model_executor/step_sync.py; the process the other ranks run is launch/rank_worker.py."""

from plait.runtime.lazy import lazy_exports

_NAMES = {"SINGLE": "group", "Group": "group", "init_group": "group", "partition": "group"}
__getattr__ = lazy_exports(__name__, _NAMES)
__all__ = list(_NAMES)
