"""One small interface for grammar backends, and the compile cache in front of them.

A backend compiles a (kind, text) pair once; each request gets its own `Matcher` over the
compiled grammar. Compiles run on a thread pool behind a bounded LRU of futures, so the
scheduler never waits on one: it parks the request until its future is done. In the scheduler each
pool thread hands its compiles to a worker process (compile_worker.py), which a runaway compile
cannot hold for good.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # annotations only: server_args imports this module's choices without torch
    import torch

KINDS = ("json_schema", "regex", "ebnf")
BACKENDS = ("auto", "xgrammar", "llguidance", "outlines", "none")
JSON_WHITESPACE = ("compact", "flexible")
JSON_KEY_ORDER = ("schema", "any")
# flexible whitespace is bounded per gap: a small model left unbounded can emit newlines until max_tokens
MAX_WHITESPACE = 12


@dataclass(frozen=True)
class JsonStyle:
    """How a JSON schema's output may be laid out (both always validate). `compact`: one space after
    ':' and ',' and none elsewhere; `flexible`: any JSON whitespace between tokens (at most
    MAX_WHITESPACE characters a gap), so the model may write newlines and indentation. Key order
    `schema`: properties in the schema's order; `any`: any order, where the backend can (xgrammar),
    else the schema's (a subset of any order). `narrow`: whether the schema may be narrowed."""

    whitespace: str = "compact"
    key_order: str = "schema"
    narrow: bool = True  # a keyword no backend enforces may become a stricter one (schema_policy.py)

    def __post_init__(self) -> None:
        if self.whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {list(JSON_WHITESPACE)}, got {self.whitespace!r}")
        if self.key_order not in JSON_KEY_ORDER:
            raise ValueError(f"json_key_order must be one of {list(JSON_KEY_ORDER)}, got {self.key_order!r}")


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

    def forced_tokens(self) -> list[int] | None:
        """The token ids every valid continuation starts with, where the matcher knows them as tokens
        (a closing plan: closing.py); None to tokenize `jump_forward_string` instead."""
        return None


def token_texts(tokenizer, n: int) -> list[str]:
    """Each of the first n token ids decoded alone, as `tokenizer.batch_decode` does it: through the Rust tokenizer
    where there is one (transformers' own loop converts every id list first, most of a second for 49k ids)."""
    ids = [[i] for i in range(n)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.batch_decode(ids)
    texts = backend.decode_batch(ids, skip_special_tokens=False)
    return [tokenizer.clean_up_tokenization(t) for t in texts] if tokenizer.clean_up_tokenization_spaces else texts


@dataclass(frozen=True)
class Built:
    """A grammar a compile worker compiled (compile_worker.py): the backend that compiled it, what that
    backend's `load` rebuilds it from, and the notes of the schema's rewrite (schema_policy.rewrite_schema)."""

    backend: str
    payload: bytes = b""
    narrowed: tuple[str, ...] = ()


class GrammarBackend(ABC):
    name: str
    # a compile its own limits bound (fuel, not time): under auto it need not be cut short to leave time for the next
    bounded_compile = False

    @abstractmethod
    def compile(self, kind: str, text: str, style: JsonStyle = JsonStyle()):
        """A compiled grammar (with `.matcher() -> Matcher`, `.backend`, the name of the backend that compiled
        it, and `.narrowed`, the notes of a JSON schema's rewrite); `style` applies to json_schema. Raises
        GrammarError."""

    def build(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> Built:
        """Compile in a compile worker. By default the payload is empty and `load` compiles again: the worker
        has shown the compile ends in time."""
        compiled = self.compile(kind, text, style)
        return Built(compiled.backend, b"", compiled.narrowed)

    def load(self, built: Built, kind: str, text: str, style: JsonStyle):
        """The compiled grammar `build` described, in this process."""
        return self.compile(kind, text, style)


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


class Compiler(Protocol):
    """What compiles for one GrammarCache pool thread."""

    def compile(self, kind: str, text: str, style: JsonStyle, started: Callable[[], None]): ...

    def close(self) -> None: ...


T = TypeVar("T")


class Lazy(Generic[T]):
    """A value built by `build()` on the first get(), once, whichever thread asks first (a build that raises is
    tried again by the next get)."""

    def __init__(self, build: Callable[[], T]):
        self._build, self._lock, self._value = build, threading.Lock(), None

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._build()
            return self._value


class InProcessCompiler:
    """Compiles on the calling thread (tests, benchmarks; the scheduler uses compile_worker's)."""

    def __init__(self, backend: GrammarBackend):
        self.backend = backend

    def compile(self, kind: str, text: str, style: JsonStyle, started: Callable[[], None]):
        started()
        return self.backend.compile(kind, text, style)

    def close(self) -> None:
        pass


class GrammarCache:
    """Compiled grammars by (kind, text, style): a bounded LRU of compiles run by a thread pool, each
    thread through a compiler of its own (`new_compiler()`: in this process by default, in a worker
    process that a runaway compile cannot hold for good in the scheduler). Failures are cached too, so
    a bad grammar sent again fails at once."""

    def __init__(self, backend: GrammarBackend | None, capacity: int, workers: int = 2,
                 new_compiler: Callable[[], Compiler] | None = None):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str, JsonStyle], Compile] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        # one compiler per pool thread; the last used is taken first, so a second one (a worker
        # process, in the scheduler) starts only when two compiles run at once
        self._compilers = [(new_compiler or (lambda: InProcessCompiler(backend)))() for _ in range(workers)]
        self._idle: queue.LifoQueue = queue.LifoQueue()
        for c in reversed(self._compilers):
            self._idle.put(c)
        self.hits = 0
        self.misses = 0

    def get(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> Compile:
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}")
        key = (kind, text, style if kind == "json_schema" else JsonStyle())
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry
            self.misses += 1
            entry = Compile()

            def started() -> None:
                if entry.started is None:
                    entry.started = time.perf_counter()

            def run():
                compiler = self._idle.get()  # as many compilers as pool threads: never waits
                try:
                    return compiler.compile(kind, text, key[2], started)
                finally:
                    self._idle.put(compiler)

            entry.future = self._pool.submit(run)
            self._entries[key] = entry
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return entry

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self._compilers:
            c.close()
