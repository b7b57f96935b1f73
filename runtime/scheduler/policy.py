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
