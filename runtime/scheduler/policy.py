"""Waiting-queue order: fcfs, or lpm (longest cached prefix first, so shared prefixes run together)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.runtime.scheduler.kv_manager import KVManager
    from plait.runtime.scheduler.req import Req

# matching every waiting request against the tree costs O(queue * prompt); past this, fcfs
_LPM_MAX_QUEUE = 128


def order_waiting(waiting: list["Req"], policy: str, kv: "KVManager") -> list["Req"]:
    if policy == "fcfs" or len(waiting) > _LPM_MAX_QUEUE or not kv.use_cache:
        return list(waiting)
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -kv.match_len(r))  # stable: ties keep arrival order
    raise ValueError(f"unknown schedule policy {policy!r}")


def fair_order(ordered: list["Req"], running: list["Req"]) -> list["Req"]:
    """Share the running slots between client requests: a waiting sequence whose request (its
    group: a batch body, or n choices) already runs more sequences goes after those whose request
    runs fewer, so one large request cannot starve small ones. Stable: ties keep `ordered`."""
    if not any(r.group for r in ordered):
        return ordered
    counts: dict[str, int] = {}
    for r in running:
        if r.group:
            counts[r.group] = counts.get(r.group, 0) + 1
    return sorted(ordered, key=lambda r: counts.get(r.group, 0) if r.group else 0)
