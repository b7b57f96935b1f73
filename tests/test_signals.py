"""Every way of stopping the server drains what is in flight: Ctrl+C and `systemctl stop` signal the
whole process group (the runtime's processes included), and the in-flight requests still finish, with
exit code 0; a second signal stops at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from server_util import Server

IN_FLIGHT = 16
TOKENS = 24


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_drains_every_request_in_flight(sig):
    srv = Server("--max-total-tokens", "8192", "--shutdown-timeout", "60")
    try:
        async def run() -> tuple[list, int, int]:
            loop = asyncio.get_running_loop()
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                tasks = [asyncio.ensure_future(client.post("/generate", json={
                    "text": f"Story number {i}:", "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True}}))
                    for i in range(IN_FLIGHT)]
                await asyncio.sleep(1.0)
                stopping = loop.run_in_executor(None, lambda: srv.stop(sig, timeout=90, group=True))
                await asyncio.sleep(0.2)
                try:  # a new request while draining is refused at once
                    late = (await client.post("/generate", json={"text": "late"})).status_code
                except httpx.TransportError:
                    late = 0  # or finds the listening socket closed
                results = await asyncio.gather(*tasks, return_exceptions=True)
                return results, await stopping, late

        results, code, late = asyncio.run(run())
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    done = [r for r in results if isinstance(r, httpx.Response) and r.status_code == 200
            and r.json()["meta_info"]["completion_tokens"] == TOKENS]
    assert len(done) == IN_FLIGHT, [r if not isinstance(r, httpx.Response) else r.text[:200] for r in results]
    assert code == 0, srv.output()[-3000:]
    assert late in (0, 503)


def test_a_second_signal_stops_at_once():
    srv = Server("--max-total-tokens", "8192", "--shutdown-timeout", "60")
    try:
        with httpx.stream("POST", srv.url + "/generate", timeout=60, json={
                "text": "A long story", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
            next(r.iter_lines())  # the stream has begun
            os.killpg(srv.proc.pid, signal.SIGINT)
            time.sleep(0.5)
            t = time.monotonic()
            code = srv.stop(signal.SIGINT, timeout=30, group=True)
            assert time.monotonic() - t < 10 and srv.proc.poll() is not None, code
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
