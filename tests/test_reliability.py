"""The reduced reliability run of `make test-reliability` (tests/reliability.py): mixed load with
clients that hang up and abort, against the real server; nothing lost, no 5xx, no leaked KV."""

from __future__ import annotations

import asyncio

import pytest
from reliability import run_load
from server_util import Server


@pytest.mark.slow  # 40-75 s; `make test-reliability` runs the full version
def test_mixed_load_with_disconnects_and_aborts_loses_nothing():
    srv = Server("--max-total-tokens", "16384", "--max-running-requests", "32")
    try:
        report = asyncio.run(run_load(srv.url, srv.headers, requests=160, concurrency=32, seed=7))
    finally:
        code = srv.stop()
    assert report.ok, report.summary() + "\n" + "\n".join(report.problems[:20])
    assert report.outcomes["disconnected"] > 0 and report.outcomes["aborted"] > 0 and report.outcomes["ok"] > 95
    assert code == 0
