"""`--grammar-backend auto`: per request, the first backend that enforces the whole constraint.

Each backend decides by its own keyword policy (schema_policy.py, measured by the soundness tests),
so a schema one backend would only approximate goes to another that enforces it exactly, and a
request is refused (a 400 listing what each backend refused) only when none can. llguidance is tried
first: it has the widest JSON-schema coverage and compiles in milliseconds (its masks are computed
per token, about 30 µs each), so no request waits seconds on a compile. xgrammar comes next (a
precomputed mask cache: its compile can take seconds, measured up to 6 s on real schemas), and
first for EBNF (its own dialect) and where only it can honour the style (keys in any order);
outlines-core last.
"""

from __future__ import annotations

from plait.runtime.constrained.base import Built, GrammarBackend, GrammarError, JsonStyle

ORDER = ("llguidance", "xgrammar", "outlines")
# keys in any order: only xgrammar writes them so (the others keep the schema's order, a subset); EBNF is
# xgrammar's own dialect (llguidance converts it to Lark)
_XGRAMMAR_FIRST = ("xgrammar", "llguidance", "outlines")
_ORDER_OF_STYLE = {"any": _XGRAMMAR_FIRST}
_KINDS_OF = {"xgrammar": ("json_schema", "regex", "ebnf"), "llguidance": ("json_schema", "regex", "ebnf"),
             "outlines": ("json_schema", "regex")}


class AutoBackend(GrammarBackend):
    name = "auto"

    def __init__(self, backends: list[GrammarBackend]):
        self.backends = backends

    def compile(self, kind: str, text: str, style: JsonStyle = JsonStyle()):
        return self.first(kind, lambda backend: backend.compile(kind, text, style), style)

    def build(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> Built:
        return self.first(kind, lambda backend: backend.build(kind, text, style), style)

    def load(self, built: Built, kind: str, text: str, style: JsonStyle):
        return self.named(built.backend).load(built, kind, text, style)

    def named(self, name: str) -> GrammarBackend:
        return next(b for b in self.backends if b.name == name)

    def candidates(self, kind: str, style: JsonStyle = JsonStyle()) -> list[GrammarBackend]:
        """The backends that compile `kind`, in the order they are tried."""
        order = _ORDER_OF_STYLE.get(style.key_order, ORDER) if kind == "json_schema" else \
            _XGRAMMAR_FIRST if kind == "ebnf" else ORDER
        return sorted((b for b in self.backends if kind in _KINDS_OF[b.name]), key=lambda b: order.index(b.name))

    def first(self, kind: str, attempt, style: JsonStyle = JsonStyle()):
        """attempt(backend) for the first candidate that does not refuse; a GrammarError listing every
        refusal when all do. (The scheduler's compile workers call this with an attempt per backend, so
        a backend whose compile runs out of its time is one more refusal: compile_worker.py.)"""
        refusals = []
        for backend in self.candidates(kind, style):
            try:
                return attempt(backend)
            except GrammarError as e:
                refusals.append(f"{backend.name}: {e}")
        raise GrammarError(f"no grammar backend can enforce this {kind}: " + " | ".join(refusals))
