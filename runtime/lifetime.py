"""How a runtime process (scheduler, rank, detokenizer, compile worker) lives and dies: it stops on STOP_SIGNAL, which its parent sends and Linux sends when
the parent dies, and removes its socket directory on the way out."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys

# how a parent stops its runtime processes, and what they get when it dies (PR_SET_PDEATHSIG)
STOP_SIGNAL = signal.SIGUSR1


def die_with_parent(root: str | None) -> None:
    """In a child process: end on STOP_SIGNAL, which the parent sends to stop it and Linux sends when
    the parent dies (PR_SET_PDEATHSIG), so no child outlives a server; remove the socket directory
    `root` (if any) on the way out: a parent killed by SIGKILL cannot remove it itself.

    SIGINT and SIGTERM are ignored: Ctrl+C, `kill -TERM -PGID`, `timeout` and `systemctl stop` signal
    the whole process group (or cgroup) at once, and the server still needs its children to finish
    the requests in flight before it stops them."""

    def on_stop(signum, frame) -> None:
        if root:
            shutil.rmtree(root, ignore_errors=True)
        os._exit(0)

    signal.signal(STOP_SIGNAL, on_stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, STOP_SIGNAL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def parent_alive(ppid: int) -> bool:
    """Fallback for platforms without PR_SET_PDEATHSIG: the parent is gone when we were re-parented."""
    return os.getppid() == ppid
