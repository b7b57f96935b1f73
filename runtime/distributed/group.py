"""The ranks of one model replica and the collectives its sharded layers call (torch.distributed).

A `Group` is handed to every layer that is split across ranks (no global process-group state in
the model code): tensor-parallel linears all-reduce their partial sums, the vocabulary-parallel
embedding and LM head reduce and gather, expert-parallel MoE layers exchange tokens with
all-to-all. `SINGLE` is the one-rank group whose collectives do nothing, so a layer's code is the
same with one rank or many. Gloo serves CPUs, NCCL GPUs; ranks on one machine
(x86) reduce, gather and broadcast through shared memory instead (shm.py: gloo's loopback round trip
costs about a millisecond).

`partition` decides every split (heads, intermediate rows, vocabulary, experts) the same way on
every rank: contiguous ranges as even as the alignment allows.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch

from plait.runtime.distributed import shm as shm_mod

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """This process's place among `size` ranks (`rank` 0 schedules); `ep` says the MoE experts are
    partitioned across them (expert parallelism) instead of each expert's rows (tensor parallelism)."""

    rank: int = 0
    size: int = 1
    ep: bool = False
    shm: object | None = field(default=None, compare=False, repr=False)  # shm.ShmComm where all ranks share a machine

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.size > 1:
            if self.shm is not None and self.shm.fits(x.numel() * x.element_size()):
                return self.shm.all_reduce(x)
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's rows of x (rank r holds sizes[r] rows; all the same width), concatenated in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        most = max(sizes)
        padded = x if x.shape[0] == most else torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])])
        if self.shm is not None and self.shm.fits(padded.numel() * padded.element_size()):
            parts = self.shm.all_gather(padded)
        else:
            parts = [torch.empty_like(padded) for _ in range(self.size)]
            dist.all_gather(parts, padded.contiguous())
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    def all_to_all(self, x: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Send rows x[...] in rank order (send_counts[r] rows to rank r); returns the rows received (in
        rank order) and how many came from each rank."""
        import torch.distributed as dist

        counts = torch.tensor(send_counts, dtype=torch.int64)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)
        recv_counts = recv.tolist()
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts)
        return out, recv_counts

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's payload on every rank (others pass None): a length, then the bytes."""
        import torch.distributed as dist

        if self.shm is not None:
            got = self.shm.broadcast(payload)
            if got is not None:
                return got

        n = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(n, 0)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(n), dtype=torch.uint8)
        if int(n):
            dist.broadcast(buf, 0)
        return payload if self.rank == 0 else buf.numpy().tobytes()

    def close(self) -> None:
        """Leave the torch.distributed world (a process that exits without it aborts in gloo's teardown)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (ranks agree on sizes they each measured)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)


SINGLE = Group()


def partition(total: int, parts: int, index: int, align: int = 1) -> range:
    """Part `index` of `parts` contiguous ranges covering [0, total), as even as possible in units of
    `align` (a quantized weight's block width, a head's rows); the last part takes the remainder."""
    if parts == 1:
        return range(total)
    units = total // align
    if units < parts:
        raise ValueError(f"cannot split {total} into {parts} parts of whole {align}s")
    base, extra = divmod(units, parts)
    start = (index * base + min(index, extra)) * align
    stop = total if index == parts - 1 else start + (base + (index < extra)) * align
    return range(start, stop)


def init_group(rank: int, size: int, init_addr: str, ep: bool, timeout_s: float, device: str = "cpu",
               one_machine: bool = True) -> Group:
    """Join the replica's torch.distributed world (rank 0 listens on `init_addr`, host:port)."""
    if size == 1:
        return Group(0, 1, ep)
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    group = Group(rank, size, ep)
    shm = _shared_memory(group, timeout_s) if one_machine and device == "cpu" and shm_mod.supported() else None
    logger.info("rank %d of %d joined at %s (%s%s)", rank, size, init_addr, backend, ", shared memory" * bool(shm))
    return Group(rank, size, ep, shm)


def _shared_memory(group: Group, timeout_s: float):
    """The group's shared buffer: rank 0 creates it and tells the others its path; it is unlinked once
    every rank has mapped it (nothing is left behind, whatever ends the processes)."""
    import torch.distributed as dist

    path = shm_mod.ShmComm.new_path() if group.rank == 0 else None
    path = group.broadcast_bytes(path.encode() if path else None).decode()
    if group.rank == 0:
        comm = shm_mod.ShmComm(path, 0, group.size, timeout_s, create=True)
    dist.barrier()  # created before the others map it
    if group.rank != 0:
        comm = shm_mod.ShmComm(path, group.rank, group.size, timeout_s, create=False)
    dist.barrier()  # mapped by all before it is unlinked
    if group.rank == 0:
        os.unlink(path)
    return comm
