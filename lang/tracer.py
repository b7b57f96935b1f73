"""Tracing: run a program body without a model to find the text it starts with.

`run_batch` uses it to compute the programs' common constant prefix once, before the batch.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from plait.lang.chat_template import ChatRoles
from plait.lang.ir import RoleBegin, RoleEnd, Seq, Text, as_expr

_MIN_PREFIX_CHARS = 64  # below a few tokens a separate request is not worth it


class _Prefix(Exception):
    """Raised by the tracing state at the first expression that needs the model."""


class _TracingState:
    """Runs a program body without a backend, collecting the text it appends before its first
    gen/select/fork/read: the program's constant prefix for these arguments."""

    def __init__(self, roles):
        self.text_ = ""
        self.roles = roles
        self.any_role = False

    def __iadd__(self, other):
        self._add(as_expr(other))
        return self

    def _add(self, e):
        if isinstance(e, Seq):
            for item in e.items:
                self._add(item)
        elif isinstance(e, Text):
            self.text_ += e.value
        elif isinstance(e, RoleBegin):
            self.text_ += self.roles.role_begin(e.role, first=not self.any_role)
            self.any_role = True
        elif isinstance(e, RoleEnd):
            self.text_ += self.roles.end[e.role]
        else:
            raise _Prefix

    def __getattr__(self, name):  # fork(), text(), ... need the model
        raise _Prefix

    def __getitem__(self, name):  # reading a result needs the model
        raise _Prefix


def common_prefix(func: Callable, roles: ChatRoles, batch_kwargs: list[dict[str, Any]], sample: int = 16) -> str:
    """The text every traced program (of the first `sample`) starts with; "" when not worth it."""
    texts = []
    for kw in batch_kwargs[:sample]:
        t = _TracingState(roles)
        try:
            func(t, **kw)
        except _Prefix:
            pass
        except Exception:  # noqa: BLE001 - a body that needs real results before its first gen cannot be traced
            return ""
        texts.append(t.text_)
    prefix = os.path.commonprefix(texts)
    return prefix if len(prefix) >= _MIN_PREFIX_CHARS else ""
