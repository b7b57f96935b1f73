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
    """Share the running slots between client requests, round-robin: a waiting sequence of a request
    (its group: a batch body, or n choices) ranks by how many of that request's sequences run or
    wait ahead of it, so one large request cannot starve small ones. A sequence without a group is
    a request of its own. Stable: ties keep `ordered`."""
    if not any(r.group for r in ordered):
        return ordered
    ahead: dict[str, int] = {}
    for r in running:
        if r.group:
            ahead[r.group] = ahead.get(r.group, 0) + 1
    ranks = {}
    for r in ordered:
        if r.group:
            ranks[id(r)] = ahead.get(r.group, 0)
            ahead[r.group] = ranks[id(r)] + 1
        else:
            ranks[id(r)] = 0
    return sorted(ordered, key=lambda r: ranks[id(r)])
