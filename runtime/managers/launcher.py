"""Start the runtime's child processes (scheduler, detokenizer) and wait until they are ready.

Each child is a fresh interpreter (`python -m plait.runtime.managers.proc_main`): no fork of a threaded
parent, and no re-import of the user's main module (so scripts need no `__main__` guard). It
gets its configuration as JSON on stdin, gets SIGKILL when the parent dies, and reports
readiness or its start-up traceback as one JSON line on a pipe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from plait.runtime.managers.ipc import Addresses, remove_dir
from plait.runtime.managers.limits import RuntimeLimits
from plait.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

_START_TIMEOUT = 600.0


@dataclass
class RuntimeProcesses:
    args: ServerArgs
    addrs: Addresses
    limits: RuntimeLimits
    tokenizer: Any
    procs: dict[str, subprocess.Popen]

    def dead(self) -> list[str]:
        """Names of children that have exited."""
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def shutdown(self, timeout: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        remove_dir(self.addrs.root)


def _child_env(name: str) -> dict[str, str]:
    """The scheduler's forward gets the cores: the detokenizer is held to one thread of each pool
    (OpenMP, the tokenizers' rayon) so it never wakes a second one beside the forward's. The
    scheduler's oneDNN primitive cache is bounded (a user's own setting wins)."""
    env = dict(os.environ)
    if name == "detokenizer":
        env.update(OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if name == "scheduler":
        # oneDNN caches a matmul primitive per shape (1,024 by default, ~0.7 MB each); prefill chunks have
        # ever new row counts, so the cache only filled memory: 256 keep every recent shape (a miss costs ~2 ms)
        env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    return env


def launch_runtime(args: ServerArgs) -> RuntimeProcesses:
    """Start the scheduler and detokenizer; load the tokenizer here meanwhile; return when all are ready."""
    addrs = Addresses.private()
    config = json.dumps({"args": dataclasses.asdict(args), "addrs": dataclasses.asdict(addrs)}) + "\n"
    procs: dict[str, subprocess.Popen] = {}
    pipes: dict[str, int] = {}
    handle = RuntimeProcesses(args, addrs, RuntimeLimits(0, 0, 0), None, procs)
    try:
        for name in ("scheduler", "detokenizer"):
            r, w = os.pipe()
            proc = subprocess.Popen([sys.executable, "-m", "plait.runtime.managers.proc_main", name, str(w)],
                                    stdin=subprocess.PIPE, pass_fds=(w,), env=_child_env(name))
            os.close(w)  # the child holds the only writer: EOF here means it died
            proc.stdin.write(config.encode())
            proc.stdin.close()
            procs[name], pipes[name] = proc, r
        with ThreadPoolExecutor(1) as pool:
            tok = pool.submit(_tokenizer, args)
            replies = {name: _wait_ready(name, procs[name], fd) for name, fd in pipes.items()}
            handle.tokenizer = tok.result()
        handle.limits = RuntimeLimits(**replies["scheduler"]["limits"])
    except BaseException:
        handle.shutdown()
        raise
    finally:
        for fd in pipes.values():
            os.close(fd)
    return handle


def _tokenizer(args: ServerArgs) -> Any:
    if args.skip_tokenizer_init:
        return None
    from plait.runtime.model_loader import load_tokenizer

    return load_tokenizer(args.model_path, args.tokenizer_path)


def _wait_ready(name: str, proc: subprocess.Popen, fd: int) -> dict:
    deadline = time.monotonic() + _START_TIMEOUT
    buf = b""
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # EOF: the child died before reporting
            buf += chunk
            if buf.endswith(b"\n"):
                reply = json.loads(buf)
                if not reply.get("ok"):
                    raise RuntimeError(f"the {name} process failed to start:\n{reply.get('error', '')}")
                return reply
        elif proc.poll() is not None:
            break
    try:
        code = proc.wait(2)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the {name} process did not start within {_START_TIMEOUT:.0f} s") from None
    raise RuntimeError(f"the {name} process exited during start-up (exit code {code})")
