"""One small interface for grammar backends, and the compile cache in front of them.

A backend compiles a (kind, text) pair once; each request gets its own `Matcher` over the
compiled grammar. Compiles run on a thread pool behind a bounded LRU of futures, so the
scheduler never waits on one: it parks the request until its future is done.
"""

from __future__ import annotations

import threading
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


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCache:
    """Compiled grammars by (kind, text): a bounded LRU of futures filled by a thread pool.
    Failures are cached too, so a bad grammar sent again fails at once."""

    def __init__(self, backend: GrammarBackend, capacity: int, workers: int = 1):
        self.backend = backend
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self.hits = 0
        self.misses = 0

    def get(self, kind: str, text: str) -> Future:
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}")
        key = (kind, text)
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._pool.submit(self.backend.compile, kind, text)
            self._entries[key] = fut
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return fut

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
