"""The expressions a program appends to its state (`s += ...`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# SGLang's regexes for gen(dtype=...) (sglang.lang.ir), so programs that import them port unchanged
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


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
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool = False
    lora: str | None = None  # the server's LoRA adapter this gen runs with (None: the program's default)


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]
    method: str = "token_length_normalized"
    temperature: float = 0.0


@dataclass
class Embed(Expr):
    """embed(name, text): the embedding of `text` (a string or a list of them; None: the program's text so far)
    in variable `name`. Adds no text."""

    name: str
    text: Any = None
    model: str | None = None  # the server's model that embeds (None: its embedding model, else its main one)


@dataclass
class VarScopeBegin(Expr):
    name: str


@dataclass
class VarScopeEnd(Expr):
    name: str


@dataclass
class Variable(Expr):
    """A variable's value, read when the expression runs (a traced program's reads are these)."""

    name: str


@dataclass
class SeparateReasoning(Expr):
    """Split each named gen/select in `names` into its answer and `<name>_reasoning_content`."""

    model_type: str | None
    names: list[str]


@dataclass
class Media(Expr):
    """sgl.image / sgl.video: kept so programs build; running one needs a vision model."""

    kind: str  # "image" | "video"
    path: Any
    num_frames: int | None = None


@dataclass
class JoinBranches(Expr):
    """join(mode="concate_and_append"): append the branches' texts (and reuse their KV)."""

    branches: list[Any]  # the ProgramStates of a fork group


def as_expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    if isinstance(x, (int, float)):
        return Text(str(x))
    raise TypeError(f"cannot append {type(x).__name__} to a program state (use str, gen, select or a role)")


def gen_names(e: Expr) -> list[str]:
    """The names of the gen/select calls inside an expression, in order."""
    if isinstance(e, (Gen, Select)):
        return [e.name] if e.name else []
    if isinstance(e, Seq):
        return [n for item in e.items for n in gen_names(item)]
    return []
