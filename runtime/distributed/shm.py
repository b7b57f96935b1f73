"""Collectives between the ranks of one machine through shared memory (CPU tensor parallelism).

Gloo's all-reduce over loopback costs about a millisecond here whatever the size (measured: 1.2-1.3 ms for
one [1, 576] row between two processes), and a decode step of a 30-layer model makes 60 of them: most of
the step. Ranks on one machine instead write their tensor into their own slot of a shared buffer, raise
their flag to the collective's sequence number, wait until every flag has reached it, and each reads every
slot (summing in rank order, so every rank gets the same bits). Two buffers alternate: a rank that is
one collective ahead writes the other one, and it cannot get two ahead, since each collective waits for
every rank to have entered it (so to have finished reading the one before). x86's memory order (stores
seen in order, loads not reordered with loads) makes the flag publish the data written before it; other
CPUs use gloo.

A tensor larger than a slot takes gloo (every rank decides from the same size, so all take the same path).
Waiting spins briefly, then sleeps in short steps (an idle rank waiting for the next step costs little),
and fails after `timeout_s` (a rank that is gone).
"""

from __future__ import annotations

import os
import platform
import time
import uuid

import torch

SLOT_BYTES = 8 << 20  # per rank and buffer
_HEADER = 64  # bytes before each slot's data (a broadcast's payload length)
_SPINS = 20000  # polls before waiting starts to sleep


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmComm:
    """One group's shared buffer: flags [size] int64, then 2 buffers x size slots."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float, create: bool):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.slot = _HEADER + SLOT_BYTES
        total = 64 * size + 2 * size * self.slot
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        self.mem = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.flags = self.mem[: 8 * size].view(torch.int64)
        self._flags = self.flags.numpy()
        self.seq = 0

    @staticmethod
    def new_path() -> str:
        return os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"plait-tp-{uuid.uuid4().hex}")

    def fits(self, nbytes: int) -> bool:
        return nbytes <= SLOT_BYTES

    def _data(self, buf: int, rank: int) -> torch.Tensor:
        start = 64 * self.size + (buf * self.size + rank) * self.slot
        return self.mem[start : start + self.slot]

    def _arrive(self) -> int:
        self.seq += 1
        return self.seq

    def _publish(self, seq: int) -> None:
        self.flags[self.rank] = seq

    def _wait(self, seq: int, ranks: range | None = None) -> None:
        flags = self._flags if ranks is None else self._flags[ranks.start : ranks.stop]
        spins, start = 0, None
        while flags.min() < seq:
            spins += 1
            if spins < _SPINS:
                continue
            now = time.monotonic()
            if start is None:
                start = now
            elif now - start > self.timeout_s:
                raise RuntimeError(f"a rank did not reach collective {seq} within {self.timeout_s:.0f} s")
            time.sleep(5e-5 if now - start < 1.0 else 1e-3)

    def _write(self, buf: int, x: torch.Tensor) -> None:
        flat = x.contiguous().view(-1).view(torch.uint8)
        self._data(buf, self.rank)[_HEADER : _HEADER + flat.numel()].copy_(flat)

    def _read(self, buf: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        return self._data(buf, rank)[_HEADER : _HEADER + n].view(like.dtype).view(like.shape)

    def _exchange(self, x: torch.Tensor) -> int:
        """Write x into this rank's slot and wait until every rank has written its own; the buffer to read."""
        seq = self._arrive()
        buf = seq % 2
        self._write(buf, x)
        self._publish(seq)
        self._wait(seq)
        return buf

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buf = self._exchange(x)
        total = self._read(buf, 0, x).clone()
        for r in range(1, self.size):
            total += self._read(buf, r, x)
        x.copy_(total)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (all the same shape), in rank order."""
        buf = self._exchange(x)
        return [self._read(buf, r, x).clone() for r in range(self.size)]

    def broadcast(self, payload: bytes | None) -> bytes | None:
        """Rank 0's payload on every rank; None where it is larger than a slot (every rank then learns so,
        and the caller sends it another way)."""
        seq = self._arrive()
        buf = seq % 2
        head = self._data(buf, 0)[:8].view(torch.int64)
        if self.rank == 0:
            n = len(payload)
            head[0] = n
            if n <= SLOT_BYTES:
                self._data(buf, 0)[_HEADER : _HEADER + n].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            self._publish(seq)
            self._wait(seq)  # every rank has entered this collective (so left the one before)
            return payload if n <= SLOT_BYTES else None
        self._publish(seq)
        self._wait(seq, range(0, 1))
        n = int(head[0])
        if n > SLOT_BYTES:
            return None
        return self._data(buf, 0)[_HEADER : _HEADER + n].numpy().tobytes()
