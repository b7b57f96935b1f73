"""ProgramState (`s`): a program's text, variables and messages, executed on its own thread.

`s += expr` only queues the expression, so the program body runs ahead until it reads a result
(`s["x"]`, `s.text()`); independent states (forks, run_batch items) therefore send their calls
concurrently and the runtime batches them.
"""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterator

from plait.lang.backends.base import Call
from plait.lang.fork import ForkGroup
from plait.lang.global_config import global_config
from plait.lang.ir import (REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, Embed, Expr, Gen, JoinBranches, Media, RoleBegin,
                           RoleEnd, Select, SeparateReasoning, Seq, Text, Variable, VarScopeBegin, VarScopeEnd,
                           as_expr, gen_names)
from plait.lang.reasoning import split_reasoning

_END = object()
# gen(dtype=...) -> (regex, extra stop strings), as SGLang's RuntimeEndpoint maps them
_DTYPES = {int: (REGEX_INT, [" ", "\n"]), float: (REGEX_FLOAT, [" ", "\n"]), str: (REGEX_STR, []),
           bool: (REGEX_BOOL, [])}
_DTYPES.update({t.__name__: v for t, v in list(_DTYPES.items())})
# output-side meta keys that a streamed piece carries for itself (the rest are cumulative)
_PIECE_KEYS = ("output_token_logprobs", "output_top_logprobs")


def _merge_piece_meta(pending: dict | None, meta: dict) -> dict:
    if pending is None:
        return meta
    merged = dict(meta)
    for key in _PIECE_KEYS:
        if key in meta or key in pending:
            merged[key] = list(pending.get(key) or []) + list(meta.get(key) or [])
    return merged


class ProgramState:
    def __init__(self, backend, defaults: dict[str, Any] | None = None, parent: "ProgramState | None" = None,
                 stream: bool = False, call: Call = Call(), spec_tokens: int | None = None):
        self.backend = backend
        self.defaults = dict(defaults or {})
        self.call_defaults = parent.call_defaults if parent else call  # run(return_logprob=...) and the like
        self.stream = parent.stream if parent else stream
        self.text_ = parent.text_ if parent else ""
        self.messages_: list[dict] = list(parent.messages_) if parent else []
        self.variables: dict[str, Any] = dict(parent.variables) if parent else {}
        self.meta_info: dict[str, dict] = dict(parent.meta_info) if parent else {}
        self.joins: tuple[str, ...] = parent.joins if parent else ()  # KV joins this state's text reuses
        self.join_info: list[dict] = []  # the backend's reply for each KV join this state made
        self.fork_start = len(parent.text_) if parent else None  # where a branch's own text starts
        self.spec_tokens = spec_tokens  # function(num_api_spec_tokens=...): API speculative execution
        self.ret_value: Any = None  # what the program function returned
        self._role: str | None = parent._role if parent else None
        self._role_start = parent._role_start if parent else 0
        self._any_role = bool(parent and (parent._any_role or parent.messages_))
        self._scopes: dict[str, int] = {}  # open var_scope -> text position
        self._spans: dict[str, tuple[int, int]] = {}  # a gen's text span, for separate_reasoning
        self._speculated = ""
        self._piece_meta: dict | None = None  # meta of streamed pieces that had no text yet
        self._cond = threading.Condition()
        self._chunks: list[tuple[str | None, str, dict | None]] = []  # (variable, text, meta), for streaming
        self._done_vars: set[str] = set(self.variables)
        self._pending = 0
        self._ended = False
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="plait-program")
        self._thread.start()

    # ---- building ------------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> "ProgramState":
        if other is None:
            raise ValueError("cannot append None to a program state")
        expr = as_expr(other)
        names = gen_names(expr) + _scope_ends(expr)
        with self._cond:
            if self._ended:
                raise RuntimeError("this program state has ended")
            self._pending += 1
            self._done_vars.difference_update(names)  # readers wait for the newest value
        self._queue.put(expr)
        return self

    def _role_common(self, role: str, expr: Any):
        if expr is not None:
            e = Seq([RoleBegin(role), as_expr(expr), RoleEnd(role)])
            self.__iadd__(e)
            return e
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.__iadd__(RoleBegin(role))
        yield
        self.__iadd__(RoleEnd(role))

    def system(self, expr: Any = None):
        """`s.system("...")` appends a system turn; `with s.system():` wraps what is appended inside."""
        return self._role_common("system", expr)

    def user(self, expr: Any = None):
        return self._role_common("user", expr)

    def assistant(self, expr: Any = None):
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside becomes the variable `name` (one string)."""
        self.__iadd__(VarScopeBegin(name))
        yield
        self.__iadd__(VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> "ForkGroup":
        """`size` copies of this state. The shared text is sent once first, as a prefill-only
        request, so every branch reads it from the radix cache."""
        size = int(size)
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        if position_ids_offset is not None:
            raise ValueError("fork(position_ids_offset=...) is not supported: branches continue the parent's positions")
        self.sync()
        if size > 1 and self.text_:
            self.backend.cache_prefix(self.text_, self._call(None))
        return ForkGroup(self, [ProgramState(self.backend, self.defaults, parent=self) for _ in range(size)])

    @contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator["ProgramState"]:
        """`with s.copy() as c:` a one-branch fork, joined (its variables gathered) on exit."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- reading -------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        with self._cond:
            while name not in self._done_vars:
                self._raise_if_failed()
                if self._pending == 0:
                    if name not in self.variables:
                        raise KeyError(f"no variable {name!r} in this program state")
                    break
                self._cond.wait()
            self._raise_if_failed()
            return self.variables[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.variables

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        with self._cond:
            self.variables[name] = value
            self._done_vars.add(name)

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

    def error(self) -> BaseException | None:
        """The exception that stopped the program, if any (after what was queued has run)."""
        with self._cond:
            while self._pending:
                self._cond.wait()
        return self._error

    def end(self) -> None:
        """No more expressions; streams finish once the queued ones are done."""
        with self._cond:
            if self._ended:
                return
            self._ended = True
        self._queue.put(_END)

    def __del__(self):
        try:
            self.end()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    # ---- streaming -----------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is produced: all of it, or one variable's (a run with stream=True)."""
        for _, text, _ in self._pieces(var_name):
            yield text

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False
                              ) -> AsyncIterator[Any]:
        """Async text_iter; with a var_name and return_meta_data, (text, meta_info) pairs whose
        output logprobs are the piece's own and whose counts are cumulative."""
        import asyncio

        it = self._pieces(var_name)
        loop = asyncio.get_running_loop()
        while True:
            piece = await loop.run_in_executor(None, next, it, _END)
            if piece is _END:
                return
            _, text, meta = piece
            yield (text, meta or {}) if return_meta_data and var_name is not None else text

    def _pieces(self, var_name: str | None) -> Iterator[tuple[str | None, str, dict | None]]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._chunks) and not self._finished(var_name):
                    self._cond.wait()
                chunks = self._chunks[i:]
                i = len(self._chunks)
                done = self._finished(var_name)
            for chunk in chunks:
                if var_name is None or chunk[0] == var_name:
                    yield chunk
            if done and i >= len(self._chunks):
                self._raise_if_failed()
                return

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
                if global_config.verbosity >= 2 and self._error is None and self.fork_start is None:
                    print(self.text_)
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

    def _append(self, text: str, var: str | None = None, meta: dict | None = None) -> None:
        with self._cond:
            self.text_ += text
            self._chunks.append((var, text, meta))
            self._cond.notify_all()

    def _fill(self, text: str) -> None:
        """Constant text: it also consumes what API speculation generated ahead, if it matches."""
        if self._speculated.startswith(text):
            self._speculated = self._speculated[len(text):]
        else:
            self._speculated = ""
        self._append(text)

    def _exec(self, expr: Expr) -> None:
        if isinstance(expr, Seq):
            for item in expr.items:
                self._exec(item)
        elif isinstance(expr, Text):
            self._fill(expr.value)
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
        elif isinstance(expr, Embed):
            self._embed(expr)
        elif isinstance(expr, VarScopeBegin):
            self._scopes[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            if expr.name not in self._scopes:
                raise ValueError(f"var_scope {expr.name!r} ends without a beginning")
            self.put(expr.name, self.text_[self._scopes.pop(expr.name):], {})
        elif isinstance(expr, Variable):
            self._fill(str(self.variables[expr.name]))
        elif isinstance(expr, SeparateReasoning):
            self._separate_reasoning(expr)
        elif isinstance(expr, JoinBranches):
            self._join_branches(expr.branches)
        elif isinstance(expr, Media):
            raise NotImplementedError(f"sgl.{expr.kind}() needs a vision-language model and image input; plait "
                                      "serves text-only models (no image or video support yet)")
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _call(self, g: Gen | None) -> Call:
        d = self.call_defaults
        if g is None:
            return Call(joins=self.joins, lora=d.lora)
        return Call(return_logprob=bool(g.return_logprob or d.return_logprob),
                    top_logprobs_num=g.top_logprobs_num or d.top_logprobs_num,
                    logprob_start_len=g.logprob_start_len if g.logprob_start_len is not None else d.logprob_start_len,
                    return_text_in_logprobs=bool(g.return_text_in_logprobs or d.return_text_in_logprobs),
                    joins=self.joins, lora=g.lora or d.lora)

    def _params(self, g: Gen) -> dict:
        params = {"skip_special_tokens": global_config.skip_special_tokens_in_output,
                  "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
                  **self.defaults, **g.params}
        if g.dtype is not None:
            if g.dtype not in _DTYPES:
                raise ValueError(f"gen dtype must be int, float, str or bool, got {g.dtype!r}")
            regex, stops = _DTYPES[g.dtype]
            params["regex"] = regex  # dtype wins over an explicit regex, as in SGLang
            if stops:
                params["stop"] = list(params.get("stop") or []) + stops
        return params

    def _gen(self, g: Gen) -> None:
        params = self._params(g)
        call = self._call(g)
        start = len(self.text_)
        if self._speculates(g, params):
            out, meta = self._spec_gen(params, call)
            self._append(out, g.name, meta)
        elif self.stream:
            self._piece_meta = None
            out, meta = self.backend.generate(self.text_, self._open_messages(), params,
                                              lambda delta, m: self._on_piece(delta, m, g.name), call)
            self._piece_meta = None
        else:
            out, meta = self.backend.generate(self.text_, self._open_messages(), params, None, call)
            self._append(out, g.name, meta)
        if g.name is not None:
            self._spans[g.name] = (start, len(self.text_))
        self.put(g.name, out, meta)

    def _on_piece(self, delta: str, meta: dict, name: str | None) -> None:
        if not delta:  # e.g. tokens held back while a UTF-8 sequence or stop string is incomplete
            self._piece_meta = _merge_piece_meta(self._piece_meta, meta)
            return
        meta = _merge_piece_meta(self._piece_meta, meta)
        self._piece_meta = None
        self._append(delta, name, meta)

    # ---- API speculative execution: one call generates ahead across constant text --------------
    def _speculates(self, g: Gen, params: dict) -> bool:
        # a completion backend only (SGLang's chat-model variant is not built), never across a grammar
        return (self.spec_tokens is not None and not self.stream and not self.backend.is_chat_model
                and bool(params.get("stop")) and not any(params.get(k) for k in ("regex", "json_schema", "ebnf")))

    def _spec_gen(self, params: dict, call: Call) -> tuple[str, dict]:
        meta: dict = {}
        if not self._speculated:
            ahead = {**params, "max_new_tokens": max(params.get("max_new_tokens", 128), self.spec_tokens),
                     "stop": []}
            self._speculated, meta = self.backend.generate(self.text_, self._open_messages(), ahead, None, call)
        found = [p for p in (self._speculated.find(s) for s in params["stop"]) if p >= 0]
        cut = min(found) if found else len(self._speculated)
        out, self._speculated = self._speculated[:cut], self._speculated[cut:]
        return out, meta

    def _embed(self, e: Embed) -> None:
        text = self.text_ if e.text is None else e.text
        many = isinstance(text, list)
        vectors = self.backend.embed(text if many else [text], model=e.model)
        self.put(e.name, vectors if many else vectors[0], {"model": e.model})

    def _select(self, sel: Select) -> None:
        if not sel.choices:
            raise ValueError("select needs at least one choice")
        index, meta = self.backend.select(self.text_, self._open_messages(), sel.choices, sel.method,
                                          sel.temperature, self._call(None))
        self._speculated = ""
        start = len(self.text_)
        self._append(sel.choices[index], sel.name, meta)
        if sel.name is not None:
            self._spans[sel.name] = (start, len(self.text_))
        self.put(sel.name, sel.choices[index], meta)

    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        for name in expr.names:
            reasoning, answer = split_reasoning(str(self.variables[name]), expr.model_type)
            start, end = self._spans.get(name, (None, None))
            if start is not None and not self.stream:  # a streamed text has been shown already
                with self._cond:
                    self.text_ = self.text_[:start] + answer + self.text_[end:]
            self.put(f"{name}_reasoning_content", reasoning, {})
            self.put(name, answer, self.meta_info.get(name, {}))

    def _join_branches(self, branches: list["ProgramState"]) -> None:
        texts = []
        for b in branches:
            b.sync()
            if b.fork_start != len(self.text_) or b.text_[: b.fork_start] != self.text_:
                raise ValueError("join(mode='concate_and_append'): the parent state changed after the fork")
            texts.append(b.text_[b.fork_start:])
        if (global_config.enable_parallel_encoding and self.backend.support_concate_and_append
                and sum(1 for t in texts if t) > 1):
            info = self.backend.join_kv(self.text_, texts, self._call(None))
            if info is not None:
                self.joins = (*self.joins, info["join_id"])
                self.join_info.append(info)
        self._speculated = ""
        self._append("".join(texts))

    def _open_messages(self) -> list[dict]:
        """The messages so far, the open role's partial content last (for chat-only backends)."""
        if self._role is None:
            return list(self.messages_)
        return [*self.messages_, {"role": self._role, "content": self.text_[self._role_start:]}]

    def put(self, name: str | None, value: Any, meta: dict) -> None:
        """Set a variable and its meta info, waking the readers waiting on it (None: nothing to set)."""
        if name is None:
            return
        with self._cond:
            self.variables[name] = value
            self.meta_info[name] = meta
            self._done_vars.add(name)
            self._cond.notify_all()


def _scope_ends(e: Expr) -> list[str]:
    if isinstance(e, VarScopeEnd):
        return [e.name]
    if isinstance(e, SeparateReasoning):
        return [*e.names, *(f"{n}_reasoning_content" for n in e.names)]
    if isinstance(e, Seq):
        return [n for item in e.items for n in _scope_ends(item)]
    return []
