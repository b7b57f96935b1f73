"""ProgramState (`s`): a program's text, variables and messages, executed on its own thread.

`s += expr` only queues the expression, so the program body runs ahead until it reads a result
(`s["x"]`, `s.text()`); independent states (forks, run_batch items) therefore send their calls
concurrently and the runtime batches them.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, AsyncIterator, Iterator

from plait.lang.ir import Expr, Gen, RoleBegin, RoleEnd, Select, Seq, Text, as_expr

_END = object()


class ProgramState:
    def __init__(self, backend, defaults: dict[str, Any] | None = None, parent: "ProgramState | None" = None,
                 stream: bool = False):
        self.backend = backend
        self.defaults = dict(defaults or {})
        self.stream = parent.stream if parent else stream
        self.text_ = parent.text_ if parent else ""
        self.messages_: list[dict] = list(parent.messages_) if parent else []
        self.variables: dict[str, Any] = dict(parent.variables) if parent else {}
        self.meta_info: dict[str, dict] = dict(parent.meta_info) if parent else {}
        self._role: str | None = None
        self._role_start = 0
        self._any_role = bool(parent and (parent._any_role or parent.messages_))
        self._cond = threading.Condition()
        self._chunks: list[tuple[str | None, str]] = []  # (variable or None, text) in order, for streaming
        self._done_vars: set[str] = set()
        self._pending = 0
        self._ended = False
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="plait-program")
        self._thread.start()

    # ---- building ------------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> "ProgramState":
        expr = as_expr(other)
        with self._cond:
            if self._ended:
                raise RuntimeError("this program state has ended")
            self._pending += 1
        self._queue.put(expr)
        return self

    def fork(self, size: int = 1) -> "ForkGroup":
        """`size` copies of this state. The shared text is sent once first, as a prefill-only
        request, so every branch reads it from the radix cache."""
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        self.sync()
        if size > 1 and self.text_:
            self.backend.cache_prefix(self.text_)
        return ForkGroup(self, [ProgramState(self.backend, self.defaults, parent=self) for _ in range(size)])

    # ---- reading -------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        with self._cond:
            while name not in self._done_vars:
                self._raise_if_failed()
                if self._pending == 0 and name not in self.variables:
                    raise KeyError(f"no variable {name!r} in this program state")
                if self._pending == 0:
                    break
                self._cond.wait()
            self._raise_if_failed()
            return self.variables[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.variables

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self.variables[name] = value

    def get_meta_info(self, name: str) -> dict:
        self[name]
        return self.meta_info.get(name, {})

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> list[dict]:
        self.sync()
        return list(self.messages_)

    def sync(self) -> "ProgramState":
        with self._cond:
            while self._pending:
                self._cond.wait()
            self._raise_if_failed()
        return self

    def end(self) -> None:
        """No more expressions; streams finish once the queued ones are done."""
        with self._cond:
            if self._ended:
                return
            self._ended = True
        self._queue.put(_END)

    @property
    def error(self) -> BaseException | None:
        return self._error

    # ---- streaming -----------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is produced: all of it, or one variable's (a run with stream=True)."""
        i = 0
        while True:
            with self._cond:
                while i >= len(self._chunks) and not self._finished(var_name):
                    self._cond.wait()
                chunks = self._chunks[i:]
                i = len(self._chunks)
                done = self._finished(var_name)
            for var, text in chunks:
                if var_name is None or var == var_name:
                    yield text
            if done and i >= len(self._chunks):
                self._raise_if_failed()
                return

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        import asyncio

        it = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        while True:
            chunk = await loop.run_in_executor(None, next, it, _END)
            if chunk is _END:
                return
            yield chunk

    def _finished(self, var_name: str | None) -> bool:
        if self._error is not None:
            return True
        if var_name is not None and var_name in self._done_vars:
            return True
        return self._ended and self._pending == 0

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- execution (the state's thread) --------------------------------------------------------
    def _run(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is _END:
                with self._cond:
                    self._cond.notify_all()
                return
            try:
                if self._error is None:
                    self._exec(expr)
            except BaseException as e:  # noqa: BLE001 - surfaced to the reader of the state
                self._error = e
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _append(self, text: str, var: str | None = None) -> None:
        with self._cond:
            self.text_ += text
            self._chunks.append((var, text))
            self._cond.notify_all()

    def _exec(self, expr: Expr) -> None:
        if isinstance(expr, Seq):
            for item in expr.items:
                self._exec(item)
        elif isinstance(expr, Text):
            self._append(expr.value)
        elif isinstance(expr, RoleBegin):
            if self._role is not None:
                raise ValueError(f"role {expr.role!r} begins inside role {self._role!r}")
            self._append(self.backend.roles().role_begin(expr.role, first=not self._any_role))
            self._role, self._role_start, self._any_role = expr.role, len(self.text_), True
        elif isinstance(expr, RoleEnd):
            if self._role != expr.role:
                raise ValueError(f"role {expr.role!r} ends but {self._role!r} is open")
            self.messages_.append({"role": expr.role, "content": self.text_[self._role_start:]})
            self._append(self.backend.roles().end[expr.role])
            self._role = None
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _gen(self, g: Gen) -> None:
        params = {**self.defaults, **g.params}
        if g.dtype is int:
            params.setdefault("regex", r"[-+]?[0-9]{1,18}")
        elif g.dtype is float:
            params.setdefault("regex", r"[-+]?[0-9]{1,12}(\.[0-9]{1,8})?")
        elif g.dtype not in (None, str):
            raise ValueError(f"gen dtype must be int, float or str, got {g.dtype!r}")
        on_delta = (lambda delta: self._append(delta, g.name)) if self.stream else None
        out, meta = self.backend.generate(self.text_, self._open_messages(), params, on_delta, g.return_logprob,
                                          g.top_logprobs_num)
        if on_delta is None:
            self._append(out, g.name)
        value: Any = out
        if g.dtype is int:
            value = int(out)
        elif g.dtype is float:
            value = float(out)
        self._set(g.name, value, meta)

    def _select(self, sel: Select) -> None:
        if not sel.choices:
            raise ValueError("select needs at least one choice")
        index, meta = self.backend.select(self.text_, self._open_messages(), sel.choices, sel.method, sel.temperature)
        self._append(sel.choices[index], sel.name)
        self._set(sel.name, sel.choices[index], meta)

    def _open_messages(self) -> list[dict]:
        """The messages so far, the open role's partial content last (for chat-only backends)."""
        if self._role is None:
            return list(self.messages_)
        return [*self.messages_, {"role": self._role, "content": self.text_[self._role_start:]}]

    def _set(self, name: str | None, value: Any, meta: dict) -> None:
        if name is None:
            return
        with self._cond:
            self.variables[name] = value
            self.meta_info[name] = meta
            self._done_vars.add(name)
            self._cond.notify_all()


class ForkGroup:
    """The branches of `s.fork(n)`: `+=` appends to every branch, `[name]` gathers a variable
    from each branch as a list, `join()` writes those lists back into the parent state."""

    def __init__(self, parent: ProgramState, states: list[ProgramState]):
        self.parent = parent
        self.states = states

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, key):
        if isinstance(key, int):
            return self.states[key]
        return [s[key] for s in self.states]

    def __iadd__(self, other: Any) -> "ForkGroup":
        for s in self.states:
            s += other
        return self

    def join(self) -> None:
        names: list[str] = []
        for s in self.states:
            s.sync()
            names += [n for n in s.variables if n not in names and s.variables[n] is not self.parent.variables.get(n)]
        for s in self.states:
            s.end()
        self.parent.sync()
        for n in names:
            self.parent.variables[n] = [s.variables.get(n) for s in self.states]
            self.parent.meta_info[n] = {"branches": [s.meta_info.get(n, {}) for s in self.states]}
            self.parent._done_vars.add(n)
