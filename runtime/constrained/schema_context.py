"""The one context the schema rewrite's passes share: the schema being rewritten and the schema as sent, the
backend and whether narrowing is on, what the passes found (problems, narrowings), and the few lookups every
pass makes (a reference resolved, a finding recorded). The passes are functions of it, one module each."""

from __future__ import annotations

import copy
import json
from typing import Any

from plait.runtime.constrained.schema_keywords import PATTERNS_INTERSECTED, SUPPORTED, lookup


def json_copy(data: Any) -> Any:
    """A deep copy of JSON data, through its text: several times faster than copy.deepcopy on a big schema."""
    return json.loads(json.dumps(data))


class SchemaRewrite:
    def __init__(self, root: Any, backend: str, narrow: bool = True):
        self.root = root
        self.original = json_copy(root)  # the passes rewrite root in place
        self.narrowed: list[str] = []  # each narrowing, said where
        self.narrower = False  # some subschema admits less than it did (a narrowing, a pinned type)
        # id(schema) -> (the schema, where its oneOf came from: a merged allOf part)
        self.origins: dict[int, tuple[dict, str]] = {}
        self.backend = backend
        self.narrow = narrow
        self.supported = SUPPORTED[backend]
        self.problems: list[str] = []
        self.seen: dict[int, Any] = {}  # id -> the subschema visited (kept alive: its id names no other)
        self.one_ofs: dict[str, list] | None = None  # schema_facts.sent_one_ofs
        self.checker = None  # schema_facts.validator
        self.original_ids: set[int] | None = None  # schema_facts.sent_ids
        self.admitted: dict[tuple[int, str], bool] = {}  # schema_facts.admits of the schema as sent
        self.remote: list[str] = []  # references to other documents, taken as admitting no value (unfetched)
        # 2020-12's format-assertion vocabulary asked for: an unknown format is refused, not ignored
        vocabulary = root.get("$vocabulary") if isinstance(root, dict) else None
        self.assert_formats = isinstance(vocabulary, dict) and any(
            "format-assertion" in str(k) and v for k, v in vocabulary.items())

    def trial(self, root: Any = None) -> "SchemaRewrite":
        """A context for a rewrite tried on the side: it shares the schemas, finds its own problems and narrows
        nothing; references resolve in `root` (None: the schema being rewritten)."""
        trial = copy.copy(self)
        trial.problems, trial.narrowed, trial.origins, trial.narrow = [], [], {}, False
        trial.root = self.root if root is None else root
        return trial

    def bad(self, ptr: str, what: str) -> None:
        self.problems.append(f"{what} at {ptr}")

    def note(self, ptr: str | None, what: str) -> None:
        """A narrowing applied at `ptr` (None: in a trial, kept or dropped by its caller)."""
        self.narrower = True
        if ptr is not None:
            self.narrowed.append(f"{what} at {ptr}")

    def unfetched(self, ref: Any, ptr: str) -> bool:
        """A reference to another document (plait fetches none): with narrowing, taken as admitting no value, so
        an anyOf branch or an optional property it names is left out (each value written is then one it cannot
        refuse); where it is required, the schema is refused naming it."""
        if not isinstance(ref, str) or ref.startswith("#") or not self.narrow:
            return False
        self.remote.append(ref)
        self.note(ptr, f"$ref {ref!r} (another document, not fetched) as no value")
        return True

    def resolve(self, ref: str, ptr: str, root: Any = None) -> Any:
        """The subschema `ref` points to, in the schema being rewritten (or in `root`)."""
        if not ref.startswith("#"):
            self.bad(ptr, f"$ref {ref!r} (only local '#/...' references are resolved)")
            return None
        node = lookup(self.root if root is None else root, ref)
        if node is None:
            self.bad(ptr, f"$ref {ref!r} that does not resolve")
        return node

    def deref(self, s: Any, root: Any = None) -> Any:
        """Where a chain of local references from `s` ends (in `root`; None: the schema being rewritten)."""
        for _ in range(16):
            if isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
                nxt = self.resolve(s["$ref"], "#", root)
                if nxt is None:
                    return s
                s = nxt
            else:
                break
        return s

    def impossible(self, sub: Any) -> bool:
        """Whether a (visited) subschema admits no value, as far as its own keywords say."""
        sub = self.deref(sub)
        return sub is False or (isinstance(sub, dict) and sub.get("enum") == [])

    def may_add_pattern(self, s: dict) -> bool:
        return "pattern" not in s or self.backend in PATTERNS_INTERSECTED

    def add_pattern(self, s: dict, pattern: str) -> None:
        """`pattern` beside the one `s` may have: both must match (an allOf of patterns, which llguidance
        intersects)."""
        if "pattern" not in s or s["pattern"] == pattern:
            s["pattern"] = pattern
        else:
            s.setdefault("allOf", []).append({"pattern": pattern})
