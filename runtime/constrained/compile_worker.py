"""Grammar compiles in a child process, so one that runs away can be stopped.

A compile cannot be interrupted inside xgrammar, llguidance or outlines-core, and some grammars
take minutes (5,000 optional symbols in an EBNF rule) or crash the compiler (a stack overflow in
C++). Run on a thread, such a compile held a core and a pool thread for good, and the compiles
queued behind it never started: two hostile requests stopped structured output for everyone.

So the scheduler's compiles run in `python -m plait.runtime.constrained.compile_worker`: a fresh
interpreter that builds the same backend from the model's tokenizer (sent as its files on stdin),
compiles one grammar at a time and sends back what the backend needs to rebuild it cheaply in
the scheduler (`GrammarBackend.build` / `load`). A compile that outlives its timeout gets its
worker killed and replaced; a worker that dies fails only the grammar it was compiling.

Wire: frames of a 4-byte big-endian length and a msgpack body (msgspec), both ways; no pickle.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import subprocess
import sys
import time
from typing import Callable

import msgspec

from plait.runtime.constrained.base import Built, GrammarBackend, GrammarError, JsonStyle, Lazy

logger = logging.getLogger(__name__)

_START_TIMEOUT = 300.0  # loading the tokenizer and building the backend (seconds, a slow machine)
_HEADER = struct.Struct(">I")


class WorkerConfig(msgspec.Struct, frozen=True):
    """What a worker builds its backend from: the model's own tokenizer, vocabulary size and end ids, read from
    the files as the scheduler reads them (model_loader.tokenizer), so the worker can start before the model loads."""

    backend: str
    model_path: str
    tokenizer_path: str | None = None


class CompileJob(msgspec.Struct, frozen=True):
    kind: str
    text: str
    whitespace: str
    key_order: str
    narrow: bool
    only: str = ""  # under auto: compile with this one backend ("": the worker's backend as configured)


class CompileReply(msgspec.Struct, frozen=True):
    backend: str = ""  # the backend that compiled it (auto picks one)
    payload: bytes = b""  # what that backend's load() rebuilds the grammar from
    error: str = ""  # a GrammarError's message: the grammar is refused
    narrowed: list[str] = []  # the notes of a JSON schema's rewrite (how it was narrowed)
    ready: bool = False  # the first frame a worker sends, once its backend is built


# ---- the parent's side ----------------------------------------------------------------------
def spawn_worker(config: WorkerConfig) -> subprocess.Popen:
    """A worker process, sent its config at once (it imports its libraries and builds its backend meanwhile)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error")  # not its note that PyTorch is absent (_preload)
    proc = subprocess.Popen([sys.executable, "-m", "plait.runtime.constrained.compile_worker"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        _write_frame(proc.stdin, config)
    except (BrokenPipeError, OSError):
        pass  # died already: CompileWorker.wait_ready() replaces it
    return proc


class CompileWorker:
    """One worker process, used by one thread at a time. `compile` sends a job and waits for its
    reply up to `timeout` seconds after the worker starts on it; past that, or if the worker dies,
    the worker is replaced and the grammar refused (GrammarError: a 400 for its request)."""

    def __init__(self, config: WorkerConfig):
        self._config = config
        self._proc: subprocess.Popen | None = None
        self._ready = False
        self._buf = b""
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        self._proc = spawn_worker(self._config)
        self._ready, self._buf = False, b""

    def wait_ready(self) -> None:
        """Wait for the worker's backend to be built (replacing a dead worker first); GrammarError
        if it cannot start."""
        if self._proc.poll() is not None:
            self._replace()
        if not self._ready:
            reply = self._read(time.monotonic() + _START_TIMEOUT)
            if reply is None or not reply.ready:
                code = self._replace()
                raise GrammarError(f"the grammar compiler failed to start (exit code {code})")
            self._ready = True

    def compile(self, job: CompileJob, timeout: float, started: Callable[[], None]) -> CompileReply:
        """The worker's reply to `job` (`error` set when a backend refused it), at most `timeout`
        seconds after it was sent (`started` is called then; wait_ready() first). Raises GrammarError
        on a timeout or a dead worker, and replaces the worker."""
        try:
            _write_frame(self._proc.stdin, job)
        except (BrokenPipeError, OSError):
            code = self._replace()
            raise GrammarError(f"the grammar compiler exited (code {code}) before compiling this {job.kind}") from None
        started()
        reply = self._read(time.monotonic() + timeout)
        if reply is None:
            timed_out = self._proc.poll() is None
            code = self._replace()
            if timed_out:
                raise GrammarError(f"the {job.kind} did not compile within {timeout:.3g} s (see --grammar-compile-timeout)")
            raise GrammarError(f"the grammar compiler crashed on this {job.kind} (exit code {code})")
        return reply

    def _read(self, deadline: float) -> CompileReply | None:
        """The next frame, or None at the deadline or at EOF (the worker died)."""
        fd = self._proc.stdout.fileno()
        while True:
            if len(self._buf) >= _HEADER.size:
                (n,) = _HEADER.unpack_from(self._buf)
                if len(self._buf) >= _HEADER.size + n:
                    body, self._buf = self._buf[_HEADER.size:_HEADER.size + n], self._buf[_HEADER.size + n:]
                    return msgspec.msgpack.decode(body, type=CompileReply)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._buf += chunk

    def _replace(self) -> int | None:
        """Kill the worker (if alive) and start another; the old one's exit code."""
        code = self.close()
        self.restarts += 1
        logger.warning("grammar compiler replaced (exit code %s)", code)
        self._start()
        return code

    def close(self) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        return code


# under auto, the longest a backend that another follows may compile: the next one takes the grammar after
FALL_THROUGH_S = 1.0


class IsolatedCompiler:
    """GrammarCache's compiler in the scheduler: compiles in a CompileWorker, loads the result here.

    Under `auto` it tries the backends one job at a time, and each but the last whose compile nothing else
    bounds gets at most half of the time left, and no more than FALL_THROUGH_S: a grammar that xgrammar would
    compile for minutes falls through to llguidance (milliseconds) within a second instead of failing at the
    timeout."""

    def __init__(self, backend: GrammarBackend | Lazy, config: WorkerConfig, timeout: float):
        self._backend, self.config, self.timeout = backend, config, timeout
        self.worker: CompileWorker | None = None  # started on first use or by start()

    @property
    def backend(self) -> GrammarBackend:
        """The scheduler's side of the backend (it loads what the worker compiled), built on first use when Lazy."""
        if not isinstance(self._backend, Lazy):
            return self._backend
        try:
            return self._backend.get()
        except Exception as e:
            raise GrammarError(f"the grammar backend could not be built: {e}") from e

    def start(self) -> None:
        """Start the worker process (it builds its backend meanwhile)."""
        if self.worker is None:
            self.worker = CompileWorker(self.config)

    def wait_ready(self) -> None:
        self.start()
        self.worker.wait_ready()

    def compile(self, kind: str, text: str, style: JsonStyle, started: Callable[[], None]):
        from plait.runtime.constrained.auto_backend import AutoBackend

        self.start()
        job = CompileJob(kind, text, style.whitespace, style.key_order, style.narrow)
        spent = [0.0]  # compile time so far (a worker's start-up after a kill is not compile time)

        def remote(job: CompileJob, share: float) -> CompileReply:
            self.worker.wait_ready()
            budget = (self.timeout - spent[0]) * share if share == 1.0 else min(
                (self.timeout - spent[0]) * share, FALL_THROUGH_S)
            if budget <= 0:
                raise GrammarError(f"no time was left to compile this {kind}")
            t = time.monotonic()
            try:
                reply = self.worker.compile(job, budget, started)
            finally:
                spent[0] += time.monotonic() - t
            if reply.error:
                raise GrammarError(reply.error)
            return reply

        if isinstance(self.backend, AutoBackend):
            last = self.backend.candidates(kind, style)[-1].name
            # a backend whose compile its own limits bound (llguidance's fuel) gets the whole timeout: which backend
            # compiles a grammar is then decided by work, not by the machine's speed (the timeout stays a safety net)
            reply = self.backend.first(kind, lambda backend: remote(
                msgspec.structs.replace(job, only=backend.name),
                1.0 if backend.name == last or backend.bounded_compile else 0.5), style)
        else:
            reply = remote(job, 1.0)
        return self.backend.load(Built(reply.backend, reply.payload, tuple(reply.narrowed)), kind, text, style)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


# ---- the worker's side ----------------------------------------------------------------------
def _read_frame(stream) -> bytes | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the scheduler closed the pipe (or died): end
    (n,) = _HEADER.unpack(header)
    return stream.read(n)


def _write_frame(stream, msg: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(msg)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def _build_backend(config: WorkerConfig) -> GrammarBackend:
    from plait.runtime.constrained import create_backend
    from plait.runtime.model_loader.tokenizer import grammar_vocab

    return create_backend(config.backend, *grammar_vocab(config.model_path, config.tokenizer_path))


def _preload() -> None:
    """Import what building a backend needs, before the config arrives (see spawn_worker). Without torch: a worker
    only compiles (no masks, no tensors), and torch would be most of its memory and start-up. Libraries that import
    torch where it is present (tvm-ffi under xgrammar, transformers) see it absent; xgrammar's own matchers, which
    need it, are left out (xgrammar_backend.import_compile_side)."""
    sys.modules.setdefault("torch", None)  # None: `import torch` raises ImportError here
    from plait.runtime.constrained.xgrammar_backend import import_compile_side

    import transformers  # noqa: F401

    import_compile_side()
    for lib in ("llguidance", "llguidance.hf", "outlines_core"):
        try:
            __import__(lib)
        except ImportError:
            pass  # an optional backend not installed: create_backend says so if it is asked for


def main() -> None:
    from plait.runtime.lifetime import die_with_parent

    die_with_parent(None)  # a worker outlives no scheduler, even one killed mid-compile
    # the frames get a private copy of fd 1; fd 1 itself goes to stderr, so nothing a library prints
    # (from Python or C++) can corrupt them
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _preload()
    frame = _read_frame(stdin)
    if frame is None:
        return
    backend = _build_backend(msgspec.msgpack.decode(frame, type=WorkerConfig))
    _write_frame(stdout, CompileReply(ready=True))
    while (frame := _read_frame(stdin)) is not None:
        job = msgspec.msgpack.decode(frame, type=CompileJob)
        try:
            chosen = backend.named(job.only) if job.only else backend
            built = chosen.build(job.kind, job.text, JsonStyle(job.whitespace, job.key_order, job.narrow))
            reply = CompileReply(backend=built.backend, payload=built.payload, narrowed=list(built.narrowed))
        except GrammarError as e:
            reply = CompileReply(error=str(e))
        except Exception as e:  # noqa: BLE001 - a compiler bug fails this grammar alone, as in-process
            reply = CompileReply(error=f"grammar compile failed: {e!r}")
        _write_frame(stdout, reply)


if __name__ == "__main__":
    main()
