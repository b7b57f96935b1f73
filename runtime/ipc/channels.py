"""ZMQ plumbing shared by the runtime's processes: addresses and typed channels.

Every channel is PUSH/PULL carrying msgpack-encoded msgspec structs of one tagged union; the
PULL side binds. Addresses are `ipc://` paths in a private temporary directory.
"""

from __future__ import annotations

import os
import shutil
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
    def private() -> "Addresses":
        """Fresh ipc:// addresses in a new directory (`root`) only this user can enter; the directory
        names its owner's pid, so a later start can remove it if it was left behind."""
        remove_stale_dirs()
        root = tempfile.mkdtemp(prefix=_PREFIX)
        os.chmod(root, 0o700)
        with open(os.path.join(root, _OWNER), "w") as f:
            f.write(str(os.getpid()))
        return Addresses(*(f"ipc://{os.path.join(root, n)}" for n in ("scheduler", "detokenizer", "client")))

    def scheduler_of(self, replica: int) -> str:
        """The inbox of data-parallel replica `replica`'s scheduler (replica 0's is `scheduler`)."""
        return self.scheduler if replica == 0 else f"{self.scheduler}-dp{replica}"

    @property
    def root(self) -> str:
        return os.path.dirname(self.scheduler[len("ipc://"):])


_PREFIX = "plait-"
_OWNER = "owner.pid"


def remove_dir(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)


def remove_stale_dirs() -> None:
    """Socket directories whose owner process is gone (a server killed before it could clean up
    and whose children could not either)."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        if not name.startswith(_PREFIX):
            continue
        try:
            with open(os.path.join(path, _OWNER)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not _pid_alive(pid):
            remove_dir(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BadMessage(ValueError):
    """A frame that does not decode as the channel's union; `rid` is its request id if one could be read."""

    def __init__(self, message: str, rid: str | None):
        super().__init__(message)
        self.rid = rid


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
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError as e:  # ValidationError included
            try:
                loose = msgspec.msgpack.decode(data)
                rid = loose.get("rid") if isinstance(loose, dict) and isinstance(loose.get("rid"), str) else None
            except msgspec.DecodeError:
                rid = None
            raise BadMessage(str(e), rid) from None

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
