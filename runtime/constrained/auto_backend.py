"""`--grammar-backend auto`: per request, the first backend that enforces the whole constraint.

Each backend decides by its own keyword policy (schema_policy.py, measured by the soundness tests),
so a schema one backend would only approximate goes to another that enforces it exactly, and a
request is refused (a 400 listing what each backend refused) only when none can. xgrammar is tried
first (its masks come from a precomputed cache: the cheapest per token), then llguidance (the widest
JSON-schema coverage), then outlines-core.
"""

from __future__ import annotations

from plait.runtime.constrained.base import GrammarBackend, GrammarError, JsonStyle

ORDER = ("xgrammar", "llguidance", "outlines")
# a regex goes to llguidance first: xgrammar's regex conversion is not exact for every pattern (measured:
# it admits "2.0" for ^(0|[1-9]\d*)(?:\+([0-9a-z]+(?:\.[0-9a-z]+)*))?$; schema_policy.py)
_ORDER_OF = {"regex": ("llguidance", "xgrammar", "outlines")}
_KINDS_OF = {"xgrammar": ("json_schema", "regex", "ebnf"), "llguidance": ("json_schema", "regex", "ebnf"),
             "outlines": ("json_schema", "regex")}


class AutoBackend(GrammarBackend):
    name = "auto"

    def __init__(self, backends: list[GrammarBackend]):
        self.backends = backends

    def compile(self, kind: str, text: str, style: JsonStyle = JsonStyle()):
        return self.first(kind, lambda backend: backend.compile(kind, text, style))

    def build(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> tuple[str, bytes]:
        return self.first(kind, lambda backend: backend.build(kind, text, style))

    def load(self, backend: str, kind: str, text: str, style: JsonStyle, payload: bytes):
        return self.named(backend).load(backend, kind, text, style, payload)

    def named(self, name: str) -> GrammarBackend:
        return next(b for b in self.backends if b.name == name)

    def candidates(self, kind: str) -> list[GrammarBackend]:
        """The backends that compile `kind`, in the order they are tried."""
        order = _ORDER_OF.get(kind, ORDER)
        return sorted((b for b in self.backends if kind in _KINDS_OF[b.name]), key=lambda b: order.index(b.name))

    def first(self, kind: str, attempt):
        """attempt(backend) for the first candidate that does not refuse; a GrammarError listing every
        refusal when all do. (The scheduler's compile workers call this with an attempt per backend, so
        a backend whose compile runs out of its time is one more refusal: compile_worker.py.)"""
        refusals = []
        for backend in self.candidates(kind):
            try:
                return attempt(backend)
            except GrammarError as e:
                refusals.append(f"{backend.name}: {e}")
        raise GrammarError(f"no grammar backend can enforce this {kind}: " + " | ".join(refusals))
