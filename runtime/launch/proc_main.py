"""Entry point of the runtime's child processes: `python -m plait.runtime.launch.proc_main ROLE FD`
(ROLE: scheduler, rank (a tensor-parallel rank > 0) or detokenizer).

The launcher starts a fresh interpreter (no fork of a threaded parent, no re-import of the
user's main module as multiprocessing's spawn would do), writes the configuration as one JSON
line on stdin, and reads one JSON readiness line from pipe FD.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback


class ReadyPipe:
    """The child's end of the readiness pipe: one JSON line, then closed."""

    def __init__(self, fd: int):
        self._file = os.fdopen(fd, "w")

    def send(self, reply: dict) -> None:
        self._file.write(json.dumps(reply) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    @contextlib.contextmanager
    def starting(self):
        """Wrap a process's start-up: on success send {"ok": True} plus what the block put in the yielded
        dict; on an exception send the traceback (the launcher shows it) and re-raise."""
        extra: dict = {}
        try:
            yield extra
        except BaseException:
            self.send({"ok": False, "error": traceback.format_exc()})
            raise
        else:
            self.send({"ok": True, **extra})
        finally:
            self.close()


def main() -> None:
    name, fd = sys.argv[1], int(sys.argv[2])
    config = json.loads(sys.stdin.readline())
    from plait.runtime.distributed.place import RankPlace
    from plait.runtime.ipc.channels import Addresses
    from plait.runtime.server_args import ServerArgs

    args = ServerArgs(**config["args"])
    addrs = Addresses(**config["addrs"])
    place = RankPlace(**config.get("place", {}))
    ready = ReadyPipe(fd)
    if name == "scheduler":
        from plait.runtime.scheduler.process import run_scheduler_process

        run_scheduler_process(args, addrs, place, ready)
    elif name == "rank":
        from plait.runtime.launch.rank_worker import run_rank_process

        run_rank_process(args, addrs, place, ready)
    elif name == "detokenizer":
        from plait.runtime.launch.detokenizer import run_detokenizer_process

        run_detokenizer_process(args, addrs, ready)
    else:
        raise SystemExit(f"unknown runtime process {name!r}")


if __name__ == "__main__":
    main()
