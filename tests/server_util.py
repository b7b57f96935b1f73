"""Start and stop a real plait server on a free loopback port (for integration tests)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

THREADS = int(os.environ.get("PLAIT_TEST_THREADS", "1"))
KEY = "test-key"  # the API key of api_server()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the server dies with the test process, even one killed by SIGKILL (PR_SET_PDEATHSIG survives the exec)
_DIE_WITH_TEST = ("import ctypes, os, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); "
                  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


class Server:
    def __init__(self, *flags: str, api_key: str | None = None, timeout: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        # the framework tests run in a venv of their own and start the server with plait's (tests/frameworks)
        python = os.environ.get("PLAIT_SERVER_PYTHON", sys.executable)
        cmd = [python, "-c", _DIE_WITH_TEST, "-m", "plait.launch_server", "--port", str(self.port),
               "--num-threads", str(THREADS), "--log-level", "warning", *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        # the log goes to a file: a pipe nobody reads fills up (64 KiB of tracebacks) and blocks the server
        self.log = tempfile.TemporaryFile()
        # a process group of its own, as a server run from a shell has: a group signal reaches it alone
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError("server did not become healthy")

    def output(self) -> str:
        """What the server has logged so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 300), **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60, group: bool = False) -> int:
        """Signal the server (with `group`, its whole process group, as Ctrl+C or systemd would); its exit code."""
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


async def slow_connection(port: int, kind: str, body: bytes, wait: float) -> tuple[float, bytes]:
    """A connection to /generate that sends nothing (`idle`), or its headers (`headers`) or its body (`body`) a
    byte every 0.5 s: (seconds until the server closed it, what it answered), waiting at most `wait` seconds
    for each read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    head = (f"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    if kind == "body":
        writer.write(head)
    trickle = {"headers": head, "body": body}.get(kind, b"")

    async def send_slowly():
        for i in range(len(trickle)):
            writer.write(trickle[i : i + 1])
            await asyncio.sleep(0.5)

    sender = asyncio.ensure_future(send_slowly())
    answer = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(4096), wait):
            answer += chunk
    except (ConnectionError, asyncio.TimeoutError):
        pass
    sender.cancel()
    writer.close()
    return time.monotonic() - start, answer


def api_server() -> "Server":
    """The server the API tests share: metrics on, a small queue limit, and batch-invariant kernels (the tests
    compare outputs across batches and cache states, in any dtype)."""
    return Server("--max-total-tokens", "16384", "--enable-metrics", "--max-running-requests", "16",
                  "--max-queued-requests", "48", "--enable-deterministic-inference", api_key=KEY)


def sse_events(lines) -> list:
    """The data of each server-sent event ("[DONE]" as a string)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
