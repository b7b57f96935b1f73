"""Entry point of the runtime's child processes: `python -m plait.runtime.managers.proc_main NAME FD`.

The launcher starts a fresh interpreter (no fork of a threaded parent, no re-import of the
user's main module as multiprocessing's spawn would do), writes the configuration as one JSON
line on stdin, and reads one JSON readiness line from pipe FD.
"""

from __future__ import annotations

import json
import os
import sys


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


def main() -> None:
    name, fd = sys.argv[1], int(sys.argv[2])
    config = json.loads(sys.stdin.readline())
    from plait.runtime.managers.ipc import Addresses
    from plait.runtime.server_args import ServerArgs

    args = ServerArgs(**config["args"])
    addrs = Addresses(**config["addrs"])
    ready = ReadyPipe(fd)
    if name == "scheduler":
        from plait.runtime.scheduler.process import run_scheduler_process

        run_scheduler_process(args, addrs, ready)
    elif name == "detokenizer":
        from plait.runtime.managers.detokenizer import run_detokenizer_process

        run_detokenizer_process(args, addrs, ready)
    else:
        raise SystemExit(f"unknown runtime process {name!r}")


if __name__ == "__main__":
    main()
