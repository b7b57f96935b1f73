"""The expressions a program appends to its state (`s += ...`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Expr:
    """Base: expressions concatenate with + (and with plain strings on either side)."""

    def __add__(self, other: Any) -> "Seq":
        return Seq([self, as_expr(other)])

    def __radd__(self, other: Any) -> "Seq":
        return Seq([as_expr(other), self])


@dataclass
class Text(Expr):
    value: str


@dataclass
class Seq(Expr):
    items: list[Expr]


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


@dataclass
class Gen(Expr):
    name: str | None
    params: dict[str, Any] = field(default_factory=dict)  # sampling_params keys (SGLang's names)
    dtype: type | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]
    method: str = "token_length_normalized"
    temperature: float = 0.0


def as_expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    if isinstance(x, (int, float)):
        return Text(str(x))
    raise TypeError(f"cannot append {type(x).__name__} to a program state (use str, gen, select or a role)")
