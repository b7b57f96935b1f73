"""ZMQ plumbing shared by the runtime's processes: addresses, typed channels, parent-death.

Every channel is PUSH/PULL carrying msgpack-encoded msgspec structs of one tagged union; the
PULL side binds. Addresses are `ipc://` paths in a private temporary directory.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq


@dataclass(frozen=True)
class Addresses:
    scheduler: str  # the scheduler's inbox
    detokenizer: str  # the detokenizer's inbox
    client: str  # the client's inbox

    @staticmethod
    def private() -> tuple["Addresses", str]:
        """Fresh ipc:// addresses in a new directory only this user can enter; returns them and the directory."""
        root = tempfile.mkdtemp(prefix="plait-")
        os.chmod(root, 0o700)
        return Addresses(*(f"ipc://{os.path.join(root, n)}" for n in ("scheduler", "detokenizer", "client"))), root


def remove_dir(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)


class Receiver:
    """PULL socket decoding one union type."""

    def __init__(self, ctx: zmq.Context, address: str, union: Any):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self._decoder = msgspec.msgpack.Decoder(union)

    def recv(self, block: bool = True):
        """The next message, or None when not blocking and nothing is waiting."""
        try:
            data = self.sock.recv(0 if block else zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return None
        return self._decoder.decode(data)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))


class Sender:
    """PUSH socket encoding structs."""

    def __init__(self, ctx: zmq.Context, address: str):
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send(self._encoder.encode(msg), copy=False)


def die_with_parent() -> None:
    """In a child process: get SIGKILL when the parent dies (Linux), so no child outlives a server."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def parent_alive(ppid: int) -> bool:
    """Fallback for platforms without PR_SET_PDEATHSIG: the parent is gone when we were re-parented."""
    return os.getppid() == ppid
