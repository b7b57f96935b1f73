"""Tracing: run a program body without a model.

`run_batch` uses it to find the programs' common constant prefix and compute it once before the
batch; `SglFunction.cache` caches the prefix that comes before any argument; `SglFunction.trace`
returns every expression a program appends (generated values and missing arguments are
placeholders).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from plait.lang.chat_template import ChatRoles
from plait.lang.ir import Embed, Expr, Gen, RoleBegin, RoleEnd, Select, Seq, Text, Variable, VarScopeBegin, VarScopeEnd, as_expr

_MIN_PREFIX_CHARS = 64  # below a few tokens a separate request is not worth it


class _Prefix(Exception):
    """Raised by a prefix-only trace at the first expression that needs the model or an argument."""


@dataclass
class Argument(Expr):
    """A program argument the trace was not given."""

    name: str

    def __format__(self, spec: str) -> str:  # f"{arg}" needs the value
        raise _Prefix

    def __str__(self) -> str:
        raise _Prefix


@dataclass
class TracedProgram:
    nodes: list[Expr] = field(default_factory=list)  # flattened, in order (forks' branches in `branches`)
    prefix: str = ""  # the constant text (role markers rendered) before the first non-constant node
    variables: dict[str, Variable] = field(default_factory=dict)
    branches: list["TracedProgram"] = field(default_factory=list)
    ret_value: Any = None


class _TracingState:
    """Stands in for ProgramState while a body runs without a backend."""

    def __init__(self, roles: ChatRoles | None, prefix_only: bool, trace: TracedProgram | None = None):
        self.roles = roles
        self.prefix_only = prefix_only
        self.trace = trace or TracedProgram()
        self.any_role = False
        self.constant = True  # still in the constant prefix

    def __iadd__(self, other):
        self._add(as_expr(other))
        return self

    def _add(self, e: Expr) -> None:
        if isinstance(e, Seq):
            for item in e.items:
                self._add(item)
            return
        text = None
        if isinstance(e, Text):
            text = e.value
        elif isinstance(e, RoleBegin) and self.roles is not None:
            text = self.roles.role_begin(e.role, first=not self.any_role)
            self.any_role = True
        elif isinstance(e, RoleEnd) and self.roles is not None:
            text = self.roles.end[e.role]
        elif isinstance(e, (VarScopeBegin, VarScopeEnd, Embed)):
            text = ""  # marks a span, or sets a variable; adds no text
        if text is None and self.prefix_only:
            raise _Prefix
        if text is None:
            self.constant = False
        elif self.constant:
            self.trace.prefix += text
        if isinstance(e, (Gen, Select)):
            name = e.name or f"{type(e).__name__.lower()}_{len(self.trace.variables)}"
            self.trace.variables[name] = Variable(name)
        elif isinstance(e, (VarScopeEnd, Embed)):
            self.trace.variables[e.name] = Variable(e.name)
        self.trace.nodes.append(e)

    def __getitem__(self, name: str) -> Variable:  # a generated value is not known without the model
        if self.prefix_only:
            raise _Prefix
        return Variable(name)

    get_var = __getitem__

    def __setitem__(self, name: str, value: Any) -> None:
        if self.prefix_only:
            raise _Prefix
        self.trace.variables[name] = Variable(name)

    set_var = __setitem__

    def _role(self, role: str, expr: Any):
        if expr is not None:
            self._add(Seq([RoleBegin(role), as_expr(expr), RoleEnd(role)]))
            return None
        return self._scope(RoleBegin(role), RoleEnd(role))

    @contextmanager
    def _scope(self, begin: Expr, end: Expr) -> Iterator[None]:
        self._add(begin)
        yield
        self._add(end)

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    def var_scope(self, name: str):
        return self._scope(VarScopeBegin(name), VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> list["_TracingState"]:
        if self.prefix_only:
            raise _Prefix
        self.constant = False
        branches = [_TracingState(self.roles, False) for _ in range(int(size))]
        for b in branches:
            b.constant, b.any_role = False, self.any_role
            self.trace.branches.append(b.trace)
        return _TracedForks(branches)

    def __getattr__(self, name):  # text(), messages(), ... need the model
        raise _Prefix


class _TracedForks(list):
    def __iadd__(self, other):
        for i, b in enumerate(self):
            b += other(i) if callable(other) and not isinstance(other, Expr) else other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        pass


def trace_program(func: Callable, roles: ChatRoles | None, kwargs: dict[str, Any], arg_names: list[str],
                  prefix_only: bool = False) -> TracedProgram:
    """Trace `func` with `kwargs`; missing arguments become Argument placeholders."""
    state = _TracingState(roles, prefix_only)
    args = {name: kwargs.get(name, Argument(name)) for name in arg_names}
    try:
        state.trace.ret_value = func(state, **args)
    except _Prefix:
        if not prefix_only:
            raise ValueError("the program needs a real value (an argument or a generated result) to be traced "
                             "beyond this point") from None
    except (TypeError, AttributeError):  # a body that computes with a placeholder stops the prefix there
        if not prefix_only:
            raise
    return state.trace


def common_prefix(func: Callable, roles: ChatRoles, batch_kwargs: list[dict[str, Any]], sample: int = 16) -> str:
    """The text every traced program (of the first `sample`) starts with; "" when not worth it."""
    texts = []
    for kw in batch_kwargs[:sample]:
        t = _TracingState(roles, prefix_only=True)
        try:
            func(t, **kw)
        except _Prefix:
            pass
        except Exception:  # noqa: BLE001 - a body that needs real results before its first gen cannot be traced
            return ""
        texts.append(t.trace.prefix)
    prefix = os.path.commonprefix(texts)
    return prefix if len(prefix) >= _MIN_PREFIX_CHARS else ""
