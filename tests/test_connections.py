"""Slow and idle clients against the real server: a connection that sends nothing, or its headers or
body a byte at a time, is answered 408 and closed within its timeout, while normal requests keep
being served; connections beyond --max-connections get a 503 at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_util import Server, slow_connection

TIMEOUT = 3.0
PER_KIND = 20
BODY = b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'


@pytest.fixture(scope="module")
def server():
    srv = Server("--max-total-tokens", "4096", "--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT),
                 "--keep-alive-timeout", str(TIMEOUT), "--max-connections", "100")
    yield srv
    srv.stop()


def test_slow_and_idle_connections_are_closed_in_time_while_others_are_served(server):
    async def run():
        held = [asyncio.ensure_future(slow_connection(server.port, kind, BODY, 4 * TIMEOUT + 10))
                for kind in ("idle", "headers", "body") for _ in range(PER_KIND)]
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            served = []
            for _ in range(3):  # served while the slow ones are held
                r = await client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
                served.append(r.status_code)
        return await asyncio.gather(*held), served

    results, served = asyncio.run(run())
    assert served == [200, 200, 200]
    for i, (seconds, answer) in enumerate(results):
        kind = ("idle", "headers", "body")[i // PER_KIND]
        assert seconds < TIMEOUT + 2, (kind, seconds)
        assert answer.startswith(b"HTTP/1.1 408"), (kind, answer[:200])
        assert b'"code": 408' in answer


def test_an_idle_keep_alive_connection_is_closed(server):
    async def run():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        answer = await reader.readuntil(b"\r\n\r\n")
        start = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), TIMEOUT + 10)  # the body, then EOF when the server closes
        writer.close()
        return answer, rest, time.monotonic() - start

    answer, rest, seconds = asyncio.run(run())
    assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" not in answer.lower()
    assert TIMEOUT - 1 < seconds < TIMEOUT + 2


def test_connections_beyond_the_limit_get_503():
    srv = Server("--max-total-tokens", "4096", "--max-connections", "4", "--header-timeout", "30")
    try:
        async def run():
            held = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(4)]
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            answer = await asyncio.wait_for(reader.read(), 10)
            for _, w in [*held, (reader, writer)]:
                w.close()
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                return answer, (await client.get("/health")).status_code

        answer, after = asyncio.run(run())
        assert answer.startswith(b"HTTP/1.1 503") and b"open connections" in answer
        assert after == 200
    finally:
        srv.stop()
