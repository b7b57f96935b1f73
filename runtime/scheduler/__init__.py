"""The scheduler: requests, KV bookkeeping, admission policy and the batching loop."""

from plait.runtime.scheduler.req import Req
from plait.runtime.scheduler.scheduler import Scheduler

__all__ = ["Req", "Scheduler"]
