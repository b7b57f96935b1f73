"""Start the runtime's child processes (scheduler, detokenizer) and wait until they are ready.

Under tensor or expert parallelism each rank is a process: rank 0 is the scheduler, ranks > 0 run
their shard of each step rank 0 broadcasts (runtime/distributed/). With --dp-size N there are N such
groups (replicas), each with its own scheduler inbox and its own torch.distributed world. With
--nnodes > 1 a machine starts only its own ranks; node 0 also serves (`launch_node` on the others).

Each child is a fresh interpreter (`python -m plait.runtime.launch.proc_main`): no fork of a threaded
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
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from plait.runtime.distributed.place import RankPlace
from plait.runtime.ipc.channels import Addresses, remove_dir
from plait.runtime.lifetime import STOP_SIGNAL
from plait.runtime.ipc.limits import RuntimeLimits
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
    # the --embedding-model's, when there is one
    encoder_limits: RuntimeLimits | None = None
    encoder_tokenizer: Any = None
    lora_adapters: list[str] = dataclasses.field(default_factory=list)  # loaded at start (--lora-paths)

    def dead(self) -> list[str]:
        """Names of children that have exited."""
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def shutdown(self, timeout: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(STOP_SIGNAL)
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
    if name in ("scheduler", "rank"):
        # oneDNN caches a matmul primitive per shape (1,024 by default, ~0.7 MB each); prefill chunks have
        # ever new row counts, so the cache only filled memory: 256 keep every recent shape (a miss costs ~2 ms)
        env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _processes(args: ServerArgs) -> list[tuple[str, str, RankPlace]]:
    """(name, role, place) of each process this machine starts; names are what a death report says."""
    out = []
    per_node = args.ranks_per_node
    first = args.node_rank * per_node
    for replica in range(args.dp_size):
        addr = ""
        if args.tp_size > 1:
            if args.dist_init_addr:
                host, port = args.dist_init_addr.rsplit(":", 1)
                addr = f"{host}:{int(port) + replica}"
            else:
                addr = f"127.0.0.1:{_free_port()}"
        dp = f"-dp{replica}" if replica else ""
        for rank in range(first, first + per_node):
            role = "scheduler" if rank == 0 else "rank"
            place = RankPlace(rank, replica, addr, args.tp_size, args.ep_size > 1, args.dist_timeout, args.nnodes == 1)
            out.append((f"scheduler{dp}" if rank == 0 else f"rank{rank}{dp}", role, place))
    if args.node_rank == 0:
        out.append(("detokenizer", "detokenizer", RankPlace()))
    return out


@dataclass
class StartingRuntime:
    """Runtime processes started and not yet ready: `wait()` for them (what the caller does meanwhile, such as
    importing its HTTP stack, overlaps their start-up)."""

    handle: RuntimeProcesses
    pipes: dict[str, int]
    started: float  # time.perf_counter() when the first process was started

    def wait(self) -> RuntimeProcesses:
        """Load the tokenizer here (node 0) while the processes start; return when all are ready."""
        args, handle = self.handle.args, self.handle
        try:
            with ThreadPoolExecutor(1) as pool:
                tok = pool.submit(_tokenizers, args) if args.node_rank == 0 else None
                replies = _wait_ready(handle.procs, self.pipes)
                handle.tokenizer, handle.encoder_tokenizer = tok.result() if tok is not None else (None, None)
            if "scheduler" in replies:
                handle.limits = RuntimeLimits(**replies["scheduler"]["limits"])
                handle.lora_adapters = replies["scheduler"].get("lora_adapters", [])
                encoder = replies["scheduler"].get("encoder_limits")
                handle.encoder_limits = RuntimeLimits(**encoder) if encoder else None
        except BaseException:
            self.abort()
            raise
        self.close()
        return handle

    def abort(self) -> None:
        """Stop the processes and drop the pipes (start-up failed, here or in the caller)."""
        self.handle.shutdown()
        self.close()

    def close(self) -> None:
        """Drop the readiness pipes (wait() does; the processes are the handle's to stop)."""
        for fd in self.pipes.values():
            os.close(fd)
        self.pipes = {}


def start_runtime(args: ServerArgs) -> StartingRuntime:
    """Start this machine's runtime processes (each gets its configuration and loads its part)."""
    addrs = Addresses.private()
    base = {"args": dataclasses.asdict(args), "addrs": dataclasses.asdict(addrs)}
    procs: dict[str, subprocess.Popen] = {}
    starting = StartingRuntime(RuntimeProcesses(args, addrs, RuntimeLimits(0, 0, 0), None, procs), {},
                               time.perf_counter())
    try:
        for name, role, place in _processes(args):
            r, w = os.pipe()
            starting.pipes[name] = r
            proc = subprocess.Popen([sys.executable, "-m", "plait.runtime.launch.proc_main", role, str(w)],
                                    stdin=subprocess.PIPE, pass_fds=(w,), env=_child_env(role))
            os.close(w)  # the child holds the only writer: EOF here means it died
            procs[name] = proc
            proc.stdin.write((json.dumps({**base, "place": dataclasses.asdict(place)}) + "\n").encode())
            proc.stdin.close()
    except BaseException:
        starting.abort()
        raise
    return starting


def launch_runtime(args: ServerArgs) -> RuntimeProcesses:
    """Start this machine's runtime processes; return when all are ready."""
    return start_runtime(args).wait()


def launch_node(args: ServerArgs) -> int:
    """A machine of --nnodes other than node 0: run its ranks until one exits (rank 0 stopped, or a
    fault) or a signal stops them. Returns the exit code (0 when stopped by a signal)."""
    rt = launch_runtime(args)
    logger.info("node %d of %d: ranks %s ready", args.node_rank, args.nnodes, ", ".join(rt.procs))
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        while not stop and not rt.dead():
            time.sleep(0.2)
        dead = rt.dead()
        if dead:
            logger.error("rank process ended: %s", ", ".join(dead))
        return 1 if dead and not stop else 0
    finally:
        rt.shutdown()


def _tokenizers(args: ServerArgs) -> tuple[Any, Any]:
    """The main model's tokenizer and the --embedding-model's (None where there is none)."""
    from plait.runtime.model_loader import load_tokenizer

    main = None if args.skip_tokenizer_init else load_tokenizer(args.model_path, args.tokenizer_path)
    encoder = load_tokenizer(args.embedding_model_path) if args.embedding_model_path else None
    return main, encoder


def _wait_ready(procs: dict[str, subprocess.Popen], pipes: dict[str, int]) -> dict[str, dict]:
    """Each child's readiness reply; the first failure (a reported error, a death) raises at once, so a
    rank that cannot start does not leave the others waiting for it."""
    deadline = time.monotonic() + _START_TIMEOUT
    bufs = {name: b"" for name in pipes}
    replies: dict[str, dict] = {}
    while len(replies) < len(pipes):
        waiting = {pipes[n]: n for n in pipes if n not in replies}
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {', '.join(waiting.values())} process did not start within {_START_TIMEOUT:.0f} s")
        for fd in select.select(list(waiting), [], [], 0.2)[0]:
            name = waiting[fd]
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the {name} process exited during start-up (exit code {_exit_code(procs[name])})")
            bufs[name] += chunk
            if bufs[name].endswith(b"\n"):
                reply = json.loads(bufs[name])
                if not reply.get("ok"):
                    raise RuntimeError(f"the {name} process failed to start:\n{reply.get('error', '')}")
                replies[name] = reply
        for name in waiting.values():
            if name not in replies and procs[name].poll() is not None and not bufs[name]:
                raise RuntimeError(f"the {name} process exited during start-up (exit code {procs[name].returncode})")
    return replies


def _exit_code(proc: subprocess.Popen) -> int | None:
    try:
        return proc.wait(2)
    except subprocess.TimeoutExpired:
        return None
