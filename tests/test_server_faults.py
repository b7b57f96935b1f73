"""Faults and shutdown of the real server: a runtime process killed under load fails its requests and the
server exits; a killed server leaves no process or socket directory behind."""

from __future__ import annotations

import signal
import time

import pytest
from server_util import Server, sse_events


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_a_dead_child_fails_requests_and_the_server_exits(victim):
    import os

    srv = Server("--max-total-tokens", "4096")
    try:
        sockets = _socket_dirs(srv.proc.pid)
        assert sockets
        with srv.client(timeout=60) as c:
            pids = c.get("/server_info").json()["pids"]
            with c.stream("POST", "/generate", json={"text": "Tell me a long story.", "stream": True,
                                                     "sampling_params": {"max_new_tokens": 4000,
                                                                         "ignore_eos": True}}) as live:
                lines = live.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                os.kill(pids[victim], signal.SIGKILL)
                t = time.monotonic()
                events = sse_events(lines)  # the stream ends with an error event, no hang
            assert time.monotonic() - t < 2.5
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == 503
            assert c.get("/health").status_code == 503  # answered, not refused, while the server winds down
        code = srv.proc.wait(timeout=15)
        assert code != 0 and time.monotonic() - t < 5
        others = [pid for name, pid in pids.items() if name not in (victim, "server")]
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in others), "a runtime process outlived the server"
        assert not any(os.path.exists(d) for d in sockets), "the socket directory was left behind"
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_a_killed_server_leaves_no_process_or_socket_directory():
    import os

    srv = Server("--max-total-tokens", "4096")
    sockets = _socket_dirs(srv.proc.pid)
    with srv.client(timeout=60) as c:
        pids = c.get("/server_info").json()["pids"]
    srv.proc.kill()
    srv.proc.wait()
    deadline = time.monotonic() + 10
    while (any(_alive(p) for p in pids.values()) or any(os.path.exists(d) for d in sockets)) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids.values())
    assert sockets and not any(os.path.exists(d) for d in sockets)


def _socket_dirs(owner: int) -> list[str]:
    import os
    import tempfile

    out = []
    for name in os.listdir(tempfile.gettempdir()):
        path = os.path.join(tempfile.gettempdir(), name)
        try:
            with open(os.path.join(path, "owner.pid")) as f:
                if int(f.read()) == owner:
                    out.append(path)
        except (OSError, ValueError):
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


