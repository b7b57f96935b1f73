"""One small interface for grammar backends, and the compile cache in front of them.

A backend compiles a (kind, text) pair once; each request gets its own `Matcher` over the
compiled grammar. Compiles run on a thread pool behind a bounded LRU of futures, so the
scheduler never waits on one: it parks the request until its future is done.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

KINDS = ("json_schema", "regex", "ebnf")


class GrammarError(ValueError):
    """The grammar is invalid or uses what the backend cannot enforce (a 400 for the client)."""


class Matcher(ABC):
    """One request's position in a compiled grammar."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by one token; False (and no change) if the grammar forbids it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a packed int32 bitmask."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its end (EOS)."""

    @abstractmethod
    def jump_forward_string(self) -> str:
        """The text every valid continuation starts with ('' if there is a choice)."""

    @abstractmethod
    def copy(self) -> "Matcher":
        """An independent matcher in the same state."""


class GrammarBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, kind: str, text: str):
        """A compiled grammar (with `.matcher() -> Matcher`); raises GrammarError."""


def complete_utf8_prefix(data: bytes, end: int) -> str:
    """The text of data[:end], where `end` is where UTF-8 decoding failed (UnicodeDecodeError.start):
    whole characters only, never a partial sequence."""
    return bytes(data[:end]).decode("utf-8")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Compile:
    """One compile on the pool: its future and when it started running (None while queued)."""

    def __init__(self):
        self.future: Future | None = None
        self.started: float | None = None

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started


class GrammarCache:
    """Compiled grammars by (kind, text): a bounded LRU of compiles run by a thread pool.
    Failures are cached too, so a bad grammar sent again fails at once."""

    def __init__(self, backend: GrammarBackend, capacity: int, workers: int = 2):
        self.backend = backend
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], Compile] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self.hits = 0
        self.misses = 0

    def get(self, kind: str, text: str) -> Compile:
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}")
        key = (kind, text)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry
            self.misses += 1
            entry = Compile()

            def run():
                entry.started = time.perf_counter()
                return self.backend.compile(kind, text)

            entry.future = self._pool.submit(run)
            self._entries[key] = entry
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return entry
