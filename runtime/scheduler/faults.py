"""A fault in one request's handling fails that request alone: it ends with a 500 (a 400 where the client's
grammar ran into a backend's limit), its traceback is logged, and the batch, the cache and every other request
go on. The request owns its failure (`Req.end`); the scheduler counts failures as it reaps them, and its KV and
draft go back as any finished request's do (only its committed tokens reach the cache)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from plait.runtime.constrained import GrammarError
from plait.runtime.ipc.messages import FinishReason
from plait.runtime.scheduler.req import Req

logger = logging.getLogger(__name__)


def fail_request(req: Req, what: str, e: BaseException) -> None:
    if isinstance(e, GrammarError):  # the client's grammar ran into a backend's limit: a 400
        logger.warning("request %s failed while %s: %s", req.rid, what, e)
        req.end(FinishReason("abort", status=400, message=f"the grammar failed while {what}: {e}"), failed=True)
    else:
        logger.error("request %s failed while %s", req.rid, what, exc_info=e)
        req.end(FinishReason("abort", status=500, message=f"internal error while {what}: {type(e).__name__}: {e}"),
                failed=True)


@contextmanager
def isolated(req: Req, what: str) -> Iterator[None]:
    """Run per-request work; an exception fails that request alone."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any bug in one request's handling is that request's failure
        fail_request(req, what, e)
