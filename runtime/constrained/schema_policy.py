"""Which JSON-schema keywords a grammar backend really enforces, and a schema rewritten for it.

Both backends silently drop keywords they cannot turn into a grammar (measured: xgrammar
ignores `uniqueItems`, `not`, `if`, `contains`, multi-part `allOf`, and treats `oneOf` as
`anyOf`; outlines-core also ignores numeric bounds). A dropped keyword means output that
does not validate, so `prepare_schema` walks every subschema reachable from the root and
raises `GrammarError` naming each keyword it cannot enforce, with its JSON pointer.

Rewrites that keep the meaning exactly:
- `oneOf` becomes `anyOf` when no instance can be valid for two branches (different JSON types,
  values one pins that the other refuses (checked with jsonschema), a property one requires that
  the other forbids or gives disjoint values, arrays whose first items differ), since then
  "exactly one" and "at least one" agree;
- `allOf` is merged into its parent keyword by keyword (bounds tighten, types and enums intersect,
  required names unite, a property both constrain gets both, `additionalProperties` keeps applying
  to the names its own part did not list);
- `if`/`then`/`else` decided by what the schema pins already, or split into an anyOf on the values
  of a required property it pins (a discriminator);
- draft-4 boolean `exclusiveMinimum`/`exclusiveMaximum` become the numeric form;
- tuple `items: [...]` (drafts 4-7) becomes `prefixItems` (+ `additionalItems` as `items`);
- an object schema naming no properties admits any (the backends would otherwise allow only `{}`);
- a `format` the backend enforces only approximately becomes an exact `pattern` (formats.py), and a
  format no validator asserts (`"format": "binary"`) is dropped, as validators ignore it.

Narrowings (unless turned off: --disable-json-narrowing): where no backend enforces a keyword, a
stricter schema whose every instance is valid for the one sent, though not every valid instance is
one of it (`narrow_keywords`, `one_of`, `exact_format`): `uniqueItems` as one item at most;
dependencies as the property required with its names, or absent; an undecided `if` as holding;
`not` of names, types or values as what it leaves; `propertyNames` as the properties it admits;
overlapping `oneOf` branches narrowed until each excludes every other as sent; formats no backend
enforces as a plainer part of them (`regex` as literal text, an IRI as a URI). Each one applied is
listed (`rewrite_schema`) and reported in the request's meta_info.

llguidance refuses what it does not implement by itself; the walker still lists its keywords, so a
keyword it would accept but not enforce is refused here, and the message names keywords the same
way for every backend.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from plait.runtime.constrained.base import GrammarError
from plait.runtime.constrained.closed_objects import close_objects
from plait.runtime.constrained.formats import EXACT, NARROWER, SUBFORMAT

# keywords with no effect on validity
_ANNOTATIONS = {
    "$schema", "$id", "id", "$comment", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "$anchor", "contentMediaType", "contentEncoding", "nullable", "markdownDescription",
    "deprecationMessage", "errorMessage", "enumDescriptions", "markdownEnumDescriptions", "x-intellij-html-description",
    "defaultSnippets", "$vocabulary", "definitions", "$defs", "discriminator", "example", "externalDocs", "xml",
}
# every keyword JSON Schema gives an assertion or applicator meaning (drafts 4 to 2020-12); any
# other key is an annotation or an extension, which validators ignore, and so do we
_ASSERTING = {
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains",
    "minContains", "contains", "maxProperties", "minProperties", "required", "dependentRequired", "dependencies",
    "properties", "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then",
    "else", "dependentSchemas", "$ref", "$dynamicRef", "$recursiveRef",
}
_COMMON = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required",
           "additionalProperties", "items", "prefixItems", "minItems", "maxItems", "pattern", "minLength", "maxLength",
           "format"}
_SUPPORTED = {
    # (xgrammar's own propertyNames leaves the names in `properties` unchecked: names_as_properties)
    # (measured: xgrammar's own unevaluatedProperties ignores names an anyOf branch or a nested allOf lists)
    "xgrammar": _COMMON | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                           "patternProperties", "maxProperties"},
    "llguidance": _COMMON | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                             "patternProperties", "minProperties", "maxProperties"},
    "outlines": _COMMON | {"minProperties"},
}
# formats jsonschema's format checker asserts, and which of them each backend enforces
_ASSERTED_FORMATS = {"email", "idn-email", "date", "date-time", "time", "duration", "uri", "uri-reference", "iri",
                     "iri-reference", "uri-template", "ipv4", "ipv6", "hostname", "idn-hostname", "uuid", "regex",
                     "json-pointer", "relative-json-pointer"}
# (each one checked against jsonschema's format checker on edge cases: tests/test_structured.py); the
# others of formats.EXACT become patterns, where the backend takes them
_FORMATS = {
    "xgrammar": {"email", "duration", "uri", "uri-reference", "ipv6", "uuid"},
    "llguidance": {"email", "duration", "uri", "ipv4", "ipv6", "uuid"},
    "outlines": {"email", "uri", "uuid"},
}
# measured: xgrammar admits "2.0" for ^(0|[1-9]\d*)(?:\+([0-9a-z]+(?:\.[0-9a-z]+)*))?$ (a semver pattern
# from the corpus), so it takes only the patterns written here (formats.py), checked on edge cases
_UNTRUSTED_PATTERNS = {"xgrammar"}
_TRUSTED_PATTERNS = {f"^{p}$" for p, _ in EXACT.values()} | {f"^{p}$" for p in NARROWER.values()}
# backends that take an allOf of patterns (llguidance intersects the regexes)
_PATTERNS_INTERSECTED = {"llguidance"}
# backends that enforce what stands beside an anyOf (the others get it copied into each branch)
_SIBLINGS_WITH_ANYOF = {"llguidance"}
# backends that enforce minLength/maxLength beside a pattern or format (xgrammar drops the lengths,
# outlines-core the pattern)
_LENGTHS_WITH_PATTERN = {"llguidance"}
_FAMILIES = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "additionalItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
               "minProperties", "maxProperties", "dependentRequired", "unevaluatedProperties", "dependencies"),
}
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def prepare_schema(schema: Any, backend: str, narrow: bool = True) -> dict | bool:
    """The schema rewritten for `backend`; GrammarError lists every keyword it cannot enforce. With
    `narrow`, a keyword no backend enforces exactly may be replaced by a stricter one (a narrowing)."""
    return rewrite_schema(schema, backend, narrow)[0]


def rewrite_schema(schema: Any, backend: str, narrow: bool = True) -> tuple[dict | bool, list[str]]:
    """prepare_schema's schema, and the narrowings it applied (each said where)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json_schema must be a JSON object")
    schema = copy.deepcopy(schema)
    walker = _Walker(schema, backend, narrow)
    walker.visit(schema, "#")
    if walker.impossible(schema):
        walker.problems.insert(0, "a schema that no value satisfies (its types, values or required parts clash) at #")
    if walker.problems:
        shown = "; ".join(walker.problems[:8]) + (f"; and {len(walker.problems) - 8} more" if len(walker.problems) > 8 else "")
        raise GrammarError(f"json_schema uses what the {backend} backend cannot enforce: {shown}")
    close_objects(schema, lambda ref: _lookup(schema, ref))
    return schema, list(dict.fromkeys(walker.narrowed))


class _Walker:
    def __init__(self, root: Any, backend: str, narrow: bool = True):
        self.root = root
        self.original = copy.deepcopy(root)  # the walk rewrites root in place
        self.narrowed: list[str] = []  # each narrowing, said where
        self.narrower = False  # some subschema admits less than it did (a narrowing, a pinned type)
        self.origins: dict[int, str] = {}  # id(schema) -> where its oneOf came from (a merged allOf part)
        self.backend = backend
        self.narrow = narrow
        self.supported = _SUPPORTED[backend]
        self.problems: list[str] = []
        self.seen: set[int] = set()

    def bad(self, ptr: str, what: str) -> None:
        self.problems.append(f"{what} at {ptr}")

    def resolve(self, ref: str, ptr: str, root: Any = None) -> Any:
        """The subschema `ref` points to, in the schema being rewritten (or in `root`)."""
        if not ref.startswith("#"):
            self.bad(ptr, f"$ref {ref!r} (only local '#/...' references are resolved)")
            return None
        node = _lookup(self.root if root is None else root, ref)
        if node is None:
            self.bad(ptr, f"$ref {ref!r} that does not resolve")
        return node

    def visit(self, s: Any, ptr: str) -> None:
        if isinstance(s, bool):
            return
        if not isinstance(s, dict):
            self.bad(ptr, "a subschema that is not an object or boolean")
            return
        if id(s) in self.seen:
            return
        self.seen.add(id(s))
        self.normalize(s, ptr)
        for key in list(s):
            if key not in _ASSERTING:
                continue
            if key not in self.supported:
                if not _is_noop(key, s[key]):
                    self.bad(f"{ptr}/{key}", f"keyword {key!r}")
                continue
        if (self.backend not in _LENGTHS_WITH_PATTERN and ("pattern" in s or "format" in s)
                and ("minLength" in s or "maxLength" in s)):
            self.bad(ptr, f"minLength/maxLength beside pattern or format (the {self.backend} backend drops one)")
        fmt = s.get("format")
        if isinstance(fmt, str) and fmt not in _FORMATS[self.backend]:
            self.bad(f"{ptr}/format", f"format {fmt!r}")
        if self.backend in _UNTRUSTED_PATTERNS and "pattern" in s and s["pattern"] not in _TRUSTED_PATTERNS:
            self.bad(f"{ptr}/pattern", f"pattern (the {self.backend} backend's regex is not exact for every pattern)")
        if "$ref" in s:
            target = self.resolve(s["$ref"], f"{ptr}/$ref") if isinstance(s["$ref"], str) else None
            if target is not None:
                self.visit(target, s["$ref"])
        for key in ("properties", "patternProperties"):
            for name, sub in (s.get(key) or {}).items():
                self.visit(sub, f"{ptr}/{key}/{name}")
        for key in ("additionalProperties", "items", "propertyNames", "unevaluatedProperties"):
            if key in s:
                self.visit(s[key], f"{ptr}/{key}")
        for key in ("anyOf", "prefixItems"):
            for i, sub in enumerate(s.get(key) or []):
                self.visit(sub, f"{ptr}/{key}/{i}")
        self.prune(s)

    def prune(self, s: dict) -> None:
        """Parts that admit no value (`false`, an empty enum: an `enum` none of whose values has the
        `type`, an `allOf` whose values clash) dropped where their parent allows it: an anyOf branch, an
        optional property, the items past a prefix. A required one leaves the parent admitting none."""
        self.values_of_type(s)  # again: an allOf merged since may have brought a type or values
        if isinstance(s.get("anyOf"), list) and s["anyOf"]:
            kept = [b for b in s["anyOf"] if not self.impossible(b)]
            if not kept:
                return _make_impossible(s)
            s["anyOf"] = kept
        props = s.get("properties")
        for name, sub in list(props.items()) if isinstance(props, dict) else []:
            if sub is False or not self.impossible(sub):
                continue
            if name in (s.get("required") or []):
                return _make_impossible(s)
            if s.get("additionalProperties") is False and not s.get("patternProperties"):
                del props[name]  # unlisted, it is forbidden anyway (and xgrammar refuses `false`)
            else:
                props[name] = False
        if "additionalProperties" in s and s["additionalProperties"] is not False \
                and self.impossible(s["additionalProperties"]):
            s["additionalProperties"] = False
        if "items" in s and s["items"] is not False and self.impossible(s["items"]):
            s.pop("items")
            s["maxItems"] = min(s.get("maxItems", 1 << 30), len(s.get("prefixItems") or []))
            if s.get("minItems", 0) > s["maxItems"]:
                return _make_impossible(s)

    def impossible(self, sub: Any) -> bool:
        """Whether a (visited) subschema admits no value, as far as its own keywords say."""
        sub = self.deref(sub)
        return sub is False or (isinstance(sub, dict) and sub.get("enum") == [])

    def normalize(self, s: dict, ptr: str) -> None:
        for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(s.get(bound), bool):  # draft 4: a flag on minimum/maximum
                if s.pop(bound) and plain in s:
                    s[bound] = s.pop(plain)
        if isinstance(s.get("items"), list):  # drafts 4-7 tuple form
            s["prefixItems"] = s.pop("items")
            s["items"] = s.pop("additionalItems", True)
        elif "additionalItems" in s:
            s.pop("additionalItems")  # without tuple items it has no effect
        for key in _COUNTS:  # 2.0 is a count too (llguidance wants an integer)
            if isinstance(s.get(key), float) and s[key].is_integer():
                s[key] = int(s[key])
        self.infer_type(s, ptr)
        self.values_of_type(s)
        if self.backend == "llguidance" and self.narrow:
            self.clamp_bounds(s, ptr)
        self.exact_format(s, ptr)
        if s.get("uniqueItems") is False or (s.get("uniqueItems") and s.get("maxItems", 2) <= 1):
            s.pop("uniqueItems")
        if "minProperties" in s and s["minProperties"] <= len(set(s.get("required") or [])):
            s.pop("minProperties")  # implied by required
        listed = [n for n, sub in (s.get("properties") or {}).items() if sub is not False]
        if s.get("additionalProperties") is False and not s.get("patternProperties") \
                and s.get("maxProperties", len(listed)) >= len(listed):
            s.pop("maxProperties", None)  # cannot be exceeded
        self.if_then_else(s, ptr)
        if "allOf" in s:
            self.merge_all_of(s, ptr)
        if "unevaluatedProperties" in s and "oneOf" not in s:  # before propertyNames sets additionalProperties
            self.unevaluated_properties(s, ptr)
        if self.narrow:
            self.narrow_keywords(s, ptr)
            if "allOf" in s:  # brought by a narrowing (then, dependentSchemas)
                self.merge_all_of(s, ptr)
        if "oneOf" in s:
            self.one_of(s, ptr)
        if "unevaluatedProperties" in s:  # a oneOf is an anyOf by now
            self.unevaluated_properties(s, ptr)
        if "unevaluatedItems" in s:
            self.unevaluated_items(s)
        if s.get("anyOf") and self.backend not in _SIBLINGS_WITH_ANYOF:
            self.siblings_into_branches(s)
        self.required_into_properties(s, ptr)
        absent = [n for n, sub in (s.get("properties") or {}).items() if sub is False]
        if absent and self.backend == "xgrammar" and s.get("additionalProperties") is False \
                and not s.get("patternProperties") and not set(absent) & set(s.get("required") or []):
            for name in absent:  # xgrammar refuses a `false` schema; unlisted, the name is forbidden anyway
                del s["properties"][name]
        if s.get("type") in ("object", ["object"]):
            if not any(k in s for k in ("properties", "patternProperties", "additionalProperties",
                                        "unevaluatedProperties", "propertyNames")):
                s["additionalProperties"] = True

    def unevaluated_properties(self, s: dict, ptr: str) -> None:
        """`unevaluatedProperties` (once allOf parts are merged in, and a oneOf is an anyOf) as the
        `additionalProperties` it amounts to: exact beside properties alone; beside an anyOf, each branch
        closed over the names it and the parent list (a narrowing: names another matching branch lists
        would also count as evaluated)."""
        extra = s["unevaluatedProperties"]
        if extra is True or extra == {} or "additionalProperties" in s:  # nothing is left unevaluated
            s.pop("unevaluatedProperties")
            return
        if any(k in s for k in _UNEVALUATED_BLOCKERS):
            return  # refused by name
        branches = s.get("anyOf")
        if not branches:
            s["additionalProperties"] = s.pop("unevaluatedProperties")
            return
        if len(branches) > 1 and not self.narrow:
            return  # refused by name
        closed = []
        for branch in branches:
            b = self.deref(branch)
            if isinstance(b, dict) and "additionalProperties" in b:
                closed.append(branch)  # it evaluates every name itself
                continue
            if not isinstance(b, dict) or any(k in b for k in _UNEVALUATED_BLOCKERS | {"anyOf", "oneOf"}):
                return
            names = {**(s.get("properties") or {}), **(b.get("properties") or {})}
            patterns = {**(s.get("patternProperties") or {}), **(b.get("patternProperties") or {})}
            closer = {"properties": {n: {} for n in names}, "additionalProperties": copy.deepcopy(extra)}
            if patterns:
                closer["patternProperties"] = {p: {} for p in patterns}
            closed.append({"allOf": [branch, closer]})
        s.pop("unevaluatedProperties")
        s["anyOf"] = closed
        if len(closed) > 1:
            self.note(ptr, "unevaluatedProperties beside anyOf as each branch closed over its own names")

    def own_unevaluated(self, part: dict, where: str) -> bool:
        """An allOf part's unevaluated* as what they say within the part, before it is merged (the other
        parts' names and items do not count as evaluated for it); False where that cannot be said."""
        for key, plain in (("unevaluatedProperties", "additionalProperties"), ("unevaluatedItems", "items")):
            if key not in part:
                continue
            if plain not in part and any(k in part for k in _UNEVALUATED_BLOCKERS | {"anyOf", "oneOf", "contains"}):
                self.bad(where, f"'allOf' part with {key!r} beside an applicator")
                return False
            extra = part.pop(key)
            part.setdefault(plain, extra)
        return True

    @staticmethod
    def unevaluated_items(s: dict) -> None:
        """`unevaluatedItems` as the `items` it amounts to, where nothing but prefixItems evaluates items
        (exact); left in place, and refused by name, beside an applicator or contains."""
        extra = s["unevaluatedItems"]
        if extra is True or extra == {} or "items" in s:
            s.pop("unevaluatedItems")
        elif not any(k in s for k in _UNEVALUATED_BLOCKERS | {"anyOf", "oneOf", "contains"}):
            s["items"] = s.pop("unevaluatedItems")

    def siblings_into_branches(self, s: dict) -> None:
        """A + anyOf [B1, B2] as anyOf [A + B1, A + B2] (exact), for backends that drop what stands
        beside an anyOf (measured: xgrammar takes the branches alone, so a parent's bounds, properties
        and required names were lost)."""
        siblings = {k: s.pop(k) for k in list(s) if k in _ASSERTING and k != "anyOf"}
        if siblings:  # less the branches no instance of the siblings can satisfy
            branches = [b for b in s["anyOf"] if not self.pair_disjoint(siblings, b)] or s["anyOf"]
            s["anyOf"] = [{"allOf": [copy.deepcopy(siblings), branch]} for branch in branches]

    def one_of(self, s: dict, ptr: str) -> None:
        """`oneOf` as `anyOf` where no instance can be in two branches. With narrowing, the branches
        narrowed to exclude one another (closed, told apart by required names or a discriminator), and
        those that still overlap another dropped: each kept branch excludes every other as sent."""
        branches = s.pop("oneOf")
        if not isinstance(branches, list):
            self.bad(f"{ptr}/oneOf", "'oneOf' that is not a list")
            return
        if len(branches) == 1 and not s.get("anyOf"):  # exactly one of one
            s["anyOf"] = branches
            return
        sent, root = self.sent_branches(s, ptr, branches)
        chosen = None
        # each branch with what stands beside the oneOf merged in (a discriminator the parent requires,
        # its type): an instance of the parent has them, so they tell branches apart too
        siblings = {k: v for k, v in s.items() if k in _ASSERTING and k not in _NOT_MERGED_INTO_BRANCHES}
        branches = [self.flattened(b, siblings, None) for b in branches]
        if sent is not None:
            sent = [self.flattened(b, siblings, root) for b in sent]
        if sent is not None:
            candidates = [branches]
            if self.narrow:
                candidates += [n for n in (
                    [self.closed_object(b) for b in branches], self.exclusive(branches, s),
                    self.discriminated(branches), self.without_pinned(branches)) if n is not None]
            best = []
            for candidate in candidates:
                kept = self.exclusive_of_others(candidate, sent, root)
                if len(kept) == len(branches) or (self.narrow and len(kept) > len(best)):
                    best = kept
                if len(best) == len(branches):
                    break
            if best:
                chosen = [b for _, b in best]
                if len(best) < len(branches) or any(b is not branches[i] for i, b in best):
                    self.narrower = True
                    self.narrowed.append(f"oneOf at {ptr}: its branches narrowed to exclude one another"
                                         + (f", {len(branches) - len(best)} of {len(branches)} left out"
                                            if len(best) < len(branches) else ""))
        if chosen is None:
            pair = self.overlapping_pair(branches, sent, root)
            self.bad(f"{ptr}/oneOf", "'oneOf' whose branches may overlap (exactly-one cannot be enforced"
                     + (f": branches {pair[0]} and {pair[1]} may both match" if pair else "") + ")")
        elif s.get("anyOf"):
            self.bad(f"{ptr}/oneOf", "'oneOf' beside 'anyOf'")
        else:
            s["anyOf"] = chosen

    def flattened(self, branch: Any, siblings: dict, root: Any) -> Any:
        """`branch` and `siblings` as one schema, where the allOf merge is exact (else `branch`); the
        branch's references resolve in `root` (None: the schema being rewritten)."""
        b = self.deref(branch, root)
        if not isinstance(b, dict) or not (siblings or isinstance(b.get("allOf"), list)):
            return branch
        trial = copy.copy(self)  # shares the schemas; its own findings, and no narrowing
        trial.problems, trial.narrowed, trial.origins, trial.narrow = [], [], {}, False
        trial.root = self.root if root is None else root
        merged = {**copy.deepcopy(siblings), "allOf": [copy.deepcopy(b)]}
        trial.merge_all_of(merged, "#")
        return branch if trial.problems or "allOf" in merged or trial.impossible(merged) else merged

    def overlapping_pair(self, branches: list, sent: list | None, root: Any) -> tuple[int, int] | None:
        """The first two branches no check tells apart (for the refusal's message)."""
        others = sent if sent is not None else branches
        return next(((i, j) for i in range(len(branches)) for j in range(i + 1, len(others))
                     if not self.pair_disjoint(branches[i], others[j], rb=root)), None)

    def without_pinned(self, branches: list) -> list | None:
        """Each branch less the values the other branches pin (`{"enum": ["linux"]}` beside `{"type":
        "string"}`), through `not`'s narrowing (longer strings, larger numbers). None where no other
        branch pins values."""
        pins = [self.pinned(b) for b in branches]
        if all(p is None for p in pins):
            return None
        out = []
        for i, branch in enumerate(branches):
            banned = sorted(set().union(*(p for j, p in enumerate(pins) if j != i and p is not None)))
            b = self.deref(branch)
            if not banned or not isinstance(b, dict) or "not" in b:
                out.append(branch)
                continue
            b = {**copy.deepcopy(b), "not": {"enum": [json.loads(v) for v in banned]}}
            self.narrow_not(b)
            out.append(branch if "not" in b else b)
        return out

    def exclusive_of_others(self, candidate: list, sent: list, root: Any) -> list[tuple[int, Any]]:
        """(index, branch) of the candidate branches that admit nothing another branch as sent admits."""
        return [(i, b) for i, b in enumerate(candidate)
                if all(self.pair_disjoint(b, sent[j], rb=root) for j in range(len(sent)) if j != i)]

    def sent_branches(self, s: dict, ptr: str, branches: list) -> tuple[list | None, Any]:
        """This oneOf's branches as sent, and the schema to resolve them in: the walk rewrites in place,
        and a definition it has narrowed elsewhere no longer says what the sender's branch admits.
        (None, None) where they cannot be found as sent."""
        for where in (ptr, self.origins.get(id(s))):  # here, or the allOf part it was merged from
            node = _lookup(self.original, where) if where else None
            found = node.get("oneOf") if isinstance(node, dict) else None
            if isinstance(found, list) and len(found) == len(branches):
                return found, self.original
        return (None, None) if self.narrower else (branches, None)  # nothing narrowed yet: as sent

    def exact_format(self, s: dict, ptr: str) -> None:
        """Drop a format no validator asserts; make one the backend enforces only approximately an
        exact pattern (left in place, and refused, where the backend cannot take that pattern)."""
        fmt = s.get("format")
        if not isinstance(fmt, str) or fmt in _FORMATS[self.backend]:
            return
        if fmt not in _ASSERTED_FORMATS:
            s.pop("format")
            return
        if self.narrow and fmt in SUBFORMAT and self.enforceable(SUBFORMAT[fmt], s):
            self.note(ptr, f"format {fmt!r} as {SUBFORMAT[fmt]!r}")
            s["format"] = fmt = SUBFORMAT[fmt]
            if fmt in _FORMATS[self.backend]:
                return
        if self.narrow and fmt in NARROWER and self.may_add_pattern(s) and (
                self.backend in _LENGTHS_WITH_PATTERN or not ("minLength" in s or "maxLength" in s)):
            s.pop("format")
            self.add_pattern(s, f"^{NARROWER[fmt]}$")
            self.note(ptr, f"format {fmt!r} as the pattern {'^' + NARROWER[fmt] + '$'!r}")
            return
        if fmt not in EXACT or not self.may_add_pattern(s):
            return
        pattern, max_length = EXACT[fmt]
        if max_length is not None and self.backend not in _LENGTHS_WITH_PATTERN:
            return
        s.pop("format")
        self.add_pattern(s, f"^{pattern}$")
        if max_length is not None:
            s["maxLength"] = min(max_length, s.get("maxLength", max_length))

    def may_add_pattern(self, s: dict) -> bool:
        return "pattern" not in s or self.backend in _PATTERNS_INTERSECTED

    def add_pattern(self, s: dict, pattern: str) -> None:
        """`pattern` beside the one `s` may have: both must match (an allOf of patterns, which llguidance
        intersects)."""
        if "pattern" not in s or s["pattern"] == pattern:
            s["pattern"] = pattern
        else:
            s.setdefault("allOf", []).append({"pattern": pattern})

    def enforceable(self, fmt: str, s: dict) -> bool:
        """The backend enforces `fmt` natively or as formats.EXACT's pattern, beside what `s` has."""
        if fmt in _FORMATS[self.backend]:
            return True
        return fmt in EXACT and self.may_add_pattern(s) and (
            self.backend in _LENGTHS_WITH_PATTERN or (EXACT[fmt][1] is None and not ("minLength" in s or "maxLength" in s)))

    def required_into_properties(self, s: dict, ptr: str) -> None:
        """Backends enforce `required` only for names listed in `properties`; list the others
        with the schema JSON Schema gives them (additionalProperties, or anything)."""
        missing = [k for k in s.get("required") or [] if k not in (s.get("properties") or {})]
        if not missing:
            return
        extra = s.get("additionalProperties", True)
        for key in missing:
            matched = [sub for p, sub in (s.get("patternProperties") or {}).items() if _search(p, key)]
            if matched:  # every pattern that matches the name applies to its value (and additionalProperties not)
                merged = copy.deepcopy(matched[0])
                for sub in matched[1:]:
                    merged = _both(merged, copy.deepcopy(sub))
                s.setdefault("properties", {})[key] = merged
            elif extra is False:
                self.bad(f"{ptr}/required", f"required name {key!r} that additionalProperties forbids")
            else:
                s.setdefault("properties", {})[key] = {} if extra is True else copy.deepcopy(extra)

    def clamp_bounds(self, s: dict, ptr: str) -> None:
        """Numeric bounds at 64-bit's edge (Java's Long.MIN_VALUE) within +-2**62: llguidance cannot build
        the range's regex beyond (measured: -2**63 fails, -2**62 compiles)."""
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            value = s.get(key)
            if _is_number(value) and abs(value) > _LLG_BOUND:
                s[key] = _LLG_BOUND if value > 0 else -_LLG_BOUND
                if (value > 0) == (key in _LOWER):  # a bound raised or lowered past it: nothing is left between
                    s[key] = value
                else:
                    self.note(ptr, f"{key} {value} as {s[key]}")

    def values_of_type(self, s: dict) -> None:
        """`enum`/`const` beside `type` keep only the values of that type (a backend may write the others:
        measured, xgrammar wrote "code" for `{"type": "array", "enum": ["code"]}`). None left: no value."""
        if "const" in s and isinstance(s.get("enum"), list):  # both (an allOf merged): the const, if listed
            const = json.dumps(s.pop("const"), sort_keys=True)
            s["enum"] = [v for v in s["enum"] if json.dumps(v, sort_keys=True) == const]
        if "type" not in s or not ("enum" in s or "const" in s):
            return
        allowed = {s["type"]} if isinstance(s["type"], str) else set(s["type"])
        if "number" in allowed:
            allowed.add("integer")
        of_type = lambda v: _type_of(v) in allowed or (_type_of(v) == "integer" and "number" in allowed)  # noqa: E731
        if "const" in s and not of_type(s["const"]):
            s.pop("const")
            s["enum"] = []
        if isinstance(s.get("enum"), list):
            s["enum"] = [v for v in s["enum"] if of_type(v)]

    def infer_type(self, s: dict, ptr: str) -> None:
        """Type keywords apply only to their type: `{"minLength": 2}` also admits 5. Backends
        ignore them without a `type`, so one family pins the type (narrower, still valid output),
        and several become an anyOf of one branch per type (exact)."""
        if "type" in s or "const" in s or "enum" in s or "$ref" in s:
            return
        families = {t for t, keys in _FAMILIES.items() if any(k in s for k in keys)}
        if len(families) == 1:
            s["type"] = families.pop()
            self.narrower = True
        elif len(families) > 1 and "anyOf" not in s:
            # each family's keywords bind its own type only: one branch per type (exact)
            branches = [{"type": t, **{k: s.pop(k) for k in _FAMILIES[t] if k in s}} for t in sorted(families)]
            rest = sorted({"object", "array", "string", "number", "boolean", "null"} - families)
            s["anyOf"] = branches + ([{"type": rest}] if rest else [])
        elif len(families) > 1:
            self.bad(ptr, f"keywords of several types ({', '.join(sorted(families))}) without 'type'")

    # ---- narrowings: a stricter schema where no backend enforces the keyword itself ----------------
    def note(self, ptr: str | None, what: str) -> None:
        self.narrower = True
        if ptr is not None:  # None: a trial (closed_object), kept or dropped by its caller
            self.narrowed.append(f"{what} at {ptr}")

    def narrow_keywords(self, s: dict, ptr: str | None) -> None:
        """Rewrites whose every instance is valid for the original (not every valid instance is one):
        - `uniqueItems` with minItems <= 1: at most one item;
        - `dependencies`/`dependentRequired`/`dependentSchemas` on a property: with names, the property
          required with them; with a schema, merged through allOf where the property is required,
          else the property absent;
        - `not` of required names: those properties absent; `not` of types: the other types."""
        if s.get("uniqueItems") is True and s.get("minItems", 0) <= 1:
            s.pop("uniqueItems")
            s["maxItems"] = 1
            self.note(ptr, "uniqueItems as at most one item")
        for key in ("dependencies", "dependentRequired", "dependentSchemas"):
            deps = s.get(key)
            if not isinstance(deps, dict):
                continue
            s.pop(key)
            required = s.setdefault("required", [])
            for name, dep in deps.items():
                if isinstance(dep, list):  # names: required with it
                    if name not in required:
                        self.note(ptr, f"{key} of {name!r} as {name!r} required")
                    required.extend([name, *dep])
                elif name in required or dep is True:
                    s.setdefault("allOf", []).append(dep)
                else:  # a schema (often a `not` of other names, which requiring could contradict): absent
                    s.setdefault("properties", {})[name] = False
                    self.note(ptr, f"{key} of {name!r} as {name!r} absent")
            s["required"] = list(dict.fromkeys(required))
        if "contains" in s or "minContains" in s or "maxContains" in s:
            self.narrow_contains(s, ptr)
        if isinstance(s.get("not"), dict):
            self.narrow_not(s)
            if "not" not in s:
                self.note(ptr, "not as what it leaves (names absent, other types or values)")
        if "propertyNames" in s and "propertyNames" not in self.supported:
            self.names_as_properties(s)
            if "propertyNames" not in s:
                self.note(ptr, "propertyNames as the properties it admits")
        if ("minProperties" in s or "maxProperties" in s) and self.backend == "llguidance":
            self.narrow_counts(s, ptr)

    def narrow_contains(self, s: dict, ptr: str | None) -> None:
        """`contains` (at least minContains items match, at most maxContains) as its matches first: the
        first minContains items match it too, and with maxContains no more items than that."""
        least, most = s.get("minContains", 1), s.get("maxContains")
        if "contains" not in s:  # min/maxContains without contains have no effect
            s.pop("minContains", None)
            s.pop("maxContains", None)
            return
        if not isinstance(least, int) or not (most is None or isinstance(most, int)) or least < 0 \
                or (most is not None and (most < least or s.get("minItems", 0) > most)) \
                or s.get("maxItems", least) < least:
            return  # refused by name (or no array satisfies it)
        contains, items = s.pop("contains"), s.get("items", True)
        s.pop("minContains", None)
        s.pop("maxContains", None)
        prefix = list(s.get("prefixItems") or [])
        for i in range(least):
            match = _both(copy.deepcopy(prefix[i] if i < len(prefix) else items), copy.deepcopy(contains))
            if i < len(prefix):
                prefix[i] = match
            else:
                prefix.append(match)
        if prefix:
            s["prefixItems"] = prefix
        s["minItems"] = max(s.get("minItems", 0), least)
        if most is not None:
            s["maxItems"] = min(s.get("maxItems", most), most)
        self.note(ptr, "contains as the first items matching it")

    def names_as_properties(self, s: dict) -> None:
        """`propertyNames` of an enum, a pattern, lengths or a narrowed format as the properties or
        patternProperties it admits, no others: listed names it refuses become absent, and its own names
        meet additionalProperties (a listed name it admits meets it too: narrower). Beside
        patternProperties, only where the pattern is theirs or theirs matches every name."""
        names = self.deref(s["propertyNames"])
        if not isinstance(names, dict):
            return
        keys = set(names) - _ANNOTATIONS - {"type"}
        if not keys and names.get("type", "string") in ("string", ["string"]):  # names are strings
            s.pop("propertyNames")
            return
        extra = s.get("additionalProperties", True)
        props = s.setdefault("properties", {})
        patterns = s.get("patternProperties") or {}
        if keys == {"enum"} and all(isinstance(n, str) for n in names["enum"]) and not patterns:
            for name in list(props):
                if name not in names["enum"]:
                    props[name] = False
            for name in names["enum"]:
                props.setdefault(name, copy.deepcopy(extra))
        else:
            if keys == {"pattern"}:
                pattern = names["pattern"]
            elif keys and keys <= {"minLength", "maxLength"}:
                pattern = f"^[\\s\\S]{{{names.get('minLength', 0)},{names.get('maxLength', '')}}}$"
            elif keys == {"format"} and names["format"] in NARROWER:
                pattern = f"^{NARROWER[names['format']]}$"
            else:
                return
            if not patterns:
                schema = copy.deepcopy(extra)
            elif list(patterns) == [pattern]:
                schema = patterns[pattern]
            elif len(patterns) == 1 and next(iter(patterns)) in ("", ".*", "^.*$"):
                schema = next(iter(patterns.values()))  # it matches every name: its schema is every name's
            else:
                return
            for name in list(props):
                if not re.search(pattern, name):
                    props[name] = False
            s["patternProperties"] = {pattern: schema}
        s.pop("propertyNames")
        s["additionalProperties"] = False

    def narrow_counts(self, s: dict, ptr: str | None) -> None:
        """min/maxProperties where llguidance takes them only with every listed property required: no
        other properties, the first listed ones required up to minProperties, the rest absent."""
        if s.get("patternProperties") or not isinstance(s.get("properties"), dict):
            return
        required = list(dict.fromkeys(s.get("required") or []))
        optional = [n for n, sub in s["properties"].items() if sub is not False and n not in required]
        low, high = s.get("minProperties", 0), s.get("maxProperties", len(required) + len(optional))
        if not (isinstance(low, int) and isinstance(high, int)) or len(required) > high \
                or len(required) + len(optional) < low:
            return
        keep = max(low - len(required), 0)  # no more than needed: a required property may recurse
        # plain values first, then references that never lead back here: requiring a property whose
        # value needs this object again would leave no finite document (an empty grammar)
        optional.sort(key=lambda n: self.recursion_rank(s["properties"][n], s))
        s["required"] = required + optional[:keep]
        for name in optional[keep:]:
            s["properties"][name] = False
        s["additionalProperties"] = False
        s.pop("minProperties", None)
        s.pop("maxProperties", None)
        self.note(ptr, "minProperties/maxProperties as the listed properties, required")

    def recursion_rank(self, sub: Any, target: dict) -> int:
        """0: `sub` holds no reference; 1: its references never reach `target`; 2: they may."""
        pending, seen = [sub], set()
        rank = 0
        while pending:
            node = pending.pop()
            if node is target and rank:
                return 2
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith("#"):
                    rank = 1
                    pending.append(_lookup(self.root, ref))
                pending.extend(v for k, v in node.items() if k != "$ref")
            elif isinstance(node, list):
                pending.extend(node)
        return rank

    def narrow_not(self, s: dict) -> None:
        """`not` of required names (alone, in allOf or anyOf): a name of each group absent; of types:
        the other types; of values: numbers above them, strings longer than them, or the values left."""
        neg = self.deref(s["not"])
        if not isinstance(neg, dict):
            return
        keys = set(neg) - _ANNOTATIONS
        groups = None  # name groups none of which may be all present
        if keys == {"anyOf"} and isinstance(neg["anyOf"], list):
            groups = [_required_names(self.deref(b)) for b in neg["anyOf"]]
        elif keys == {"allOf"} and isinstance(neg["allOf"], list):
            parts = [_required_names(self.deref(b)) for b in neg["allOf"]]
            groups = [sum(parts, [])] if all(p is not None for p in parts) else None
        else:
            groups = [_required_names(neg)]
        if groups and all(groups):
            required = set(s.get("required") or [])
            absent = [next((n for n in g if n not in required), None) for g in groups]
            if None not in absent:
                s.pop("not")
                for name in absent:
                    s.setdefault("properties", {})[name] = False
            return
        if keys == {"type"}:
            banned = {neg["type"]} if isinstance(neg["type"], str) else set(neg["type"])
            if "number" in banned:
                banned.add("integer")
            allowed = self.types(s) - banned - ({"number"} if "integer" in banned else set())
            if allowed:
                s.pop("not")
                s["type"] = sorted(allowed) if len(allowed) > 1 else allowed.pop()
        elif keys in ({"enum"}, {"const"}):
            banned = neg["enum"] if "enum" in keys else [neg["const"]]
            if not isinstance(banned, list):
                return
            kept = self.pinned(s)
            if kept is not None:
                s.pop("not")
                values = [v for v in map(json.loads, sorted(kept)) if v not in banned]
                s.pop("const", None)
                s["enum"] = values
            elif self.types(s) <= {"integer", "number"} and all(_is_number(v) for v in banned):
                top = max(banned)
                if s.get("maximum", top + 1) > top and s.get("exclusiveMaximum", top + 2) > top + 1:
                    s.pop("not")
                    if s.get("minimum", top) <= top:
                        s["exclusiveMinimum"] = max(top, s.get("exclusiveMinimum", top))
            elif self.types(s) == {"string"} and all(isinstance(v, str) for v in banned):
                s.pop("not")
                s["minLength"] = max(s.get("minLength", 0), max(len(v) for v in banned) + 1)

    def decided(self, cond: Any, s: dict) -> bool | None:
        """Whether `cond` holds for every instance of `s` (True), for none (False), or either (None),
        judged on the properties both pin to values (a discriminator: `{"properties": {"kind":
        {"const": "a"}}}`)."""
        if not isinstance(cond, dict) or set(cond) - _ANNOTATIONS - {"properties", "required"}:
            return None
        required = set(s.get("required") or [])
        holds = True
        for name in cond.get("required") or []:
            if name not in required:
                holds = False if (s.get("properties") or {}).get(name) is False else None
        for name, sub in (cond.get("properties") or {}).items():
            want = self.pinned(sub)
            have = self.pinned((s.get("properties") or {}).get(name))
            if want is None or have is None:
                return None if holds is not False else False
            if not want & have and name in required:
                return False
            if not have <= want:
                holds = None
        return holds

    def if_then_else(self, s: dict, ptr: str | None, context: dict | None = None) -> None:
        """Decided by what the schema (or `context`, the parent an allOf part merges into) pins already,
        or split on a pinned property's values: exact. Else, with narrowing, the `if` taken to hold,
        with the names it pins present (so that a later `if` on the same name is decided)."""
        if "if" not in s:
            if "then" in s or "else" in s:  # without `if` they have no effect
                s.pop("then", None)
                s.pop("else", None)
            return
        context = context if context is not None else s
        cond, then, other = s["if"], s.get("then", True), s.get("else", True)
        holds = self.decided(cond, context)
        split = self.split_on_values(cond, then, other, context) if holds is None else None
        if holds is None and (split is None or s.get("anyOf")):
            if not self.narrow:
                return  # refused by name
            self.note(ptr, "if/then/else as its `if` holding")
            if isinstance(cond, dict):
                pins = [n for n, sub in (cond.get("properties") or {}).items() if self.pinned(sub) is not None]
                cond = {**cond, "required": list(dict.fromkeys((cond.get("required") or []) + pins))}
        for key in ("if", "then", "else"):
            s.pop(key, None)
        if holds is None and split is not None and not s.get("anyOf"):
            s["anyOf"] = split
        else:
            s.setdefault("allOf", []).extend([other] if holds is False else [then] if holds else [cond, then])

    def split_on_values(self, cond: Any, then: Any, other: Any, s: dict) -> list | None:
        """An `if` on one required property that the schema pins to finitely many values, as an anyOf
        of the values it admits (with `then`) and the others (with `else`): exact."""
        if not isinstance(cond, dict) or set(cond) - _ANNOTATIONS - {"properties", "required"}:
            return None
        props = cond.get("properties") or {}
        if len(props) != 1:
            return None
        (name, sub), = props.items()
        want, have = self.pinned(sub), self.pinned((s.get("properties") or {}).get(name))
        if want is None or have is None or name not in (s.get("required") or []) \
                or not set(cond.get("required") or []) <= {name}:
            return None
        inside, outside = sorted(have & want), sorted(have - want)
        if not inside or not outside:
            return None
        return [{"allOf": [{"properties": {name: {"enum": [json.loads(v) for v in values]}}}, branch]}
                for values, branch in ((inside, then), (outside, other))]

    def pinned(self, sub: Any) -> set[str] | None:
        """The values a subschema allows (as JSON text), where it pins them (const, enum, or an allOf
        with such parts)."""
        sub = self.deref(sub)
        if isinstance(sub, dict) and isinstance(sub.get("allOf"), list):
            sets = [v for v in (self.pinned(p) for p in sub["allOf"]) if v is not None]
            return set.intersection(*sets) if sets else None
        return _values(sub)

    def closed_object(self, branch: Any) -> Any:
        """An object branch of a oneOf narrowed so that branches become disjoint: no other properties
        than it names, at least one of them present, its own narrowings applied (`not` of a name)."""
        b = self.deref(branch)
        if not isinstance(b, dict) or self.types(b) != {"object"} or any(
                k in b for k in ("patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")):
            return branch
        b = copy.deepcopy(b)
        b["type"] = "object"
        self.narrow_keywords(b, None)
        if "allOf" in b:
            return branch
        if "additionalProperties" not in b:
            for name in b.get("required") or []:
                b.setdefault("properties", {}).setdefault(name, {})
            b["additionalProperties"] = False
        named = [n for n, sub in (b.get("properties") or {}).items() if sub is not False]
        if b["additionalProperties"] is False and not b.get("required") and named:
            b["required"] = [named[0]]  # else `{}` would match every such branch
        return b

    def merge_all_of(self, s: dict, ptr: str) -> None:
        """Merge `allOf` parts into their parent, keyword by keyword, where the conjunction has a form
        the backends take (exact): bounds tighten, types and enums intersect, required names unite, a
        property both constrain gets both (as its own allOf), and `additionalProperties` keeps applying
        to the names its own part did not list."""
        parts = s.pop("allOf")
        if not isinstance(parts, list):
            self.bad(f"{ptr}/allOf", "'allOf' that is not a list")
            return
        queue = [(f"{ptr}/allOf/{i}", part) for i, part in enumerate(parts)]
        while queue:
            where, part = queue.pop(0)
            if part is True:
                continue
            if not isinstance(part, dict):
                self.bad(where, "'allOf' with a false part")
                continue
            if "$ref" in part and len([k for k in part if k not in _ANNOTATIONS]) == 1:
                target = self.resolve(part["$ref"], where)
                if not isinstance(target, dict) or "$ref" in target:
                    self.bad(where, "'allOf' of a reference that cannot be merged")
                    continue
                part, where = target, part["$ref"]
            part = copy.deepcopy(part)
            if not self.own_unevaluated(part, where):
                continue
            self.infer_type(part, where)
            self.if_then_else(part, where, context=s)
            if self.narrow:
                self.narrow_keywords(part, where)
            # a part's own parts next, before the following parts (a narrowed `if` is merged before the next is judged)
            queue[0:0] = [(f"{where}/allOf/{i}", sub) for i, sub in enumerate(part.pop("allOf", None) or [])]
            if "oneOf" in part:
                self.origins[id(s)] = where
            self.merge_part(s, part, where)

    def merge_part(self, s: dict, part: dict, where: str) -> None:
        for closer, other in ((s, part), (part, s)):  # names one part did not list meet its additionalProperties
            extra = closer.get("additionalProperties", True)
            if extra is True:
                continue
            for name in list(other.get("properties") or {}):
                if name in (closer.get("properties") or {}):
                    continue
                if closer.get("patternProperties"):
                    self.bad(where, "'allOf' whose parts list different properties beside patternProperties")
                    return
                closer.setdefault("properties", {})[name] = copy.deepcopy(extra)
        for x, y in ((s, part), (part, s)):  # x's items (without a prefix) apply to y's prefix positions too
            if "prefixItems" in y and "prefixItems" not in x and "items" in x and isinstance(y["prefixItems"], list):
                y["prefixItems"] = [_both(p, copy.deepcopy(x["items"])) for p in y["prefixItems"]]
        for key, value in part.items():
            if key not in _ASSERTING:
                continue
            if key not in s or s[key] == value:
                s[key] = value
                continue
            if key == "anyOf" and isinstance(value, list) and isinstance(s[key], list):
                # (A1 or A2) and (B1 or B2): every pair, less those no instance satisfies
                merged = [_both(x, y) for x in s[key] for y in value if not self.pair_disjoint(x, y)]
                merged = merged if 0 < len(merged) <= 32 else _CLASH
            else:
                merged = _merge_keyword(key, s[key], value)
            if key == "pattern" and self.may_add_pattern(s):
                self.add_pattern(s, value)
                continue
            if merged is _CLASH and key in ("type", "enum", "const"):
                return _make_impossible(s)  # no value is of both types or both values: the parts clash
            if merged is _CLASH:
                self.bad(where, f"'allOf' whose parts both constrain {key!r}")
            else:
                s[key] = merged

    # ---- oneOf disjointness -----------------------------------------------------------------
    # Disjointness is judged between a branch as it will be enforced (rewritten, maybe narrowed: root
    # None) and the others as sent (root self.original): a narrowed branch must still exclude the
    # others' every instance, not only their narrowed ones.
    def deref(self, s: Any, root: Any = None) -> Any:
        for _ in range(16):
            if isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
                nxt = self.resolve(s["$ref"], "#", root)
                if nxt is None:
                    return s
                s = nxt
            else:
                break
        return s

    def types(self, s: Any, root: Any = None) -> set[str]:
        s = self.deref(s, root)
        if not isinstance(s, dict):
            return set(_JSON_TYPES) if s is not False else set()
        if "const" in s:
            return {_type_of(s["const"])}
        if isinstance(s.get("enum"), list):
            return {_type_of(v) for v in s["enum"]}
        t = s.get("type")
        if isinstance(t, str):
            out = {t}
        elif isinstance(t, list):
            out = set(t)
        elif "anyOf" in s or "oneOf" in s:
            out = set().union(*(self.types(b, root) for b in (s.get("anyOf") or s.get("oneOf") or [])))
        else:
            out = set(_JSON_TYPES)
        if "integer" in out or "number" in out:  # 1 is both an integer and a number
            out |= {"integer", "number"}
        return out

    def pair_disjoint(self, a: Any, b: Any, depth: int = 0, ra: Any = None, rb: Any = None) -> bool:
        """No instance is valid for both (a resolved in `ra`, b in `rb`: None the rewritten schema)."""
        a, b = self.flattened(a, {}, ra), self.flattened(b, {}, rb)  # an allOf as one schema, where it merges
        a, b = self.deref(a, ra), self.deref(b, rb)
        if a is False or b is False:
            return True
        if not self.types(a, ra) & self.types(b, rb):
            return True
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return False
        for x, y in ((a, b), (b, a)):  # the values one pins, each checked against the other
            values = self.pinned(x)
            if values is not None and not any(self.admits(y, json.loads(v)) for v in values):
                return True
        if depth >= 4:  # recursive schemas: stop looking
            return False
        for x, rx, y, ry in ((a, ra, b, rb), (b, rb, a, ra)):  # every instance of x is in one of its branches
            branches = x.get("anyOf") or x.get("oneOf")
            if isinstance(branches, list) and branches and len(branches) <= 64 and all(
                    self.pair_disjoint(branch, y, depth + 1, rx, ry) for branch in branches):
                return True
        for x, rx, y, ry in ((a, ra, b, rb), (b, rb, a, ra)):
            for key in x.get("required") or []:
                xp, yp = (x.get("properties") or {}).get(key), (y.get("properties") or {}).get(key)
                # x has the name, and where y's instance has it, y gives it values x's cannot take
                if xp is not None and yp is not None and self.pair_disjoint(xp, yp, depth + 1, rx, ry):
                    return True
                if (y.get("additionalProperties") is False and key not in (y.get("properties") or {})
                        and not y.get("patternProperties")) or (y.get("properties") or {}).get(key) is False:
                    return True
        if self.types(a, ra) == self.types(b, rb) == {"array"} \
                and min(a.get("minItems", 0), b.get("minItems", 0)) >= 1 \
                and isinstance(a.get("items"), dict) and isinstance(b.get("items"), dict) \
                and not a.get("prefixItems") and not b.get("prefixItems"):
            return self.pair_disjoint(a["items"], b["items"], depth + 1, ra, rb)  # their first items differ
        return False

    def admits(self, sub: Any, value: Any) -> bool:
        """Whether jsonschema finds `value` valid for `sub` (references resolved in the schema as sent:
        the walk rewrites the one it is given). True when it cannot tell."""
        import jsonschema

        root = self.original if isinstance(self.original, dict) else {}
        probe = {k: v for k, v in root.items() if k in ("definitions", "$defs")}
        probe["allOf"] = [sub]
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        try:
            return cls(probe, format_checker=cls.FORMAT_CHECKER).is_valid(value)
        except Exception:  # noqa: BLE001 - an unresolvable reference, a bad pattern: assume it admits
            return True

    def discriminated(self, branches: list) -> list | None:
        """Object branches that pin one property to values no other branch allows, each narrowed to
        require it (absent, it would leave every branch open). None where no property does."""
        resolved = [self.deref(b) for b in branches]
        if not all(isinstance(b, dict) and "object" in self.types(b) for b in resolved):
            return None
        for name in (resolved[0].get("properties") or {}):
            pins = [self.pinned((b.get("properties") or {}).get(name)) for b in resolved]
            if any(p is None for p in pins) or sum(len(p) for p in pins) != len(set().union(*pins)):
                continue
            out = []
            for b in resolved:
                b = copy.deepcopy(b)
                b["type"] = "object"
                b["required"] = list(dict.fromkeys((b.get("required") or []) + [name]))
                out.append(b)
            return out
        return None

    def exclusive(self, branches: list, parent: dict) -> list | None:
        """Object branches narrowed to exclude one another: each forbids the names the others require
        and it does not (so the one an instance matches is decided by which names it has). None where
        two branches require the same names, or a forbidden name is one the parent requires."""
        resolved = [self.deref(b) for b in branches]
        if not all(isinstance(b, dict) and "object" in self.types(b) for b in resolved):
            return None
        needs = [set(b.get("required") or []) for b in resolved]
        if len({frozenset(n) for n in needs}) < len(needs):
            return None
        out = []
        for i, b in enumerate(resolved):
            forbid = set().union(*(needs[j] - needs[i] for j in range(len(needs)) if j != i))
            if forbid & set(parent.get("required") or []):
                return None
            b = copy.deepcopy(b)
            b["type"] = "object"
            for name in sorted(forbid):
                b.setdefault("properties", {})[name] = False
            out.append(b)
        return out


_CLASH = object()
# in-place applicators whose evaluated names or items the unevaluated* rewrites do not follow
_UNEVALUATED_BLOCKERS = {"$ref", "allOf", "if", "then", "else", "dependentSchemas", "not", "$dynamicRef",
                         "$recursiveRef"}
_LLG_BOUND = 2 ** 62
_NOT_MERGED_INTO_BRANCHES = {"anyOf", "oneOf", "allOf", "if", "then", "else", "not", "$ref"}


def _make_impossible(s: dict) -> None:
    """`s` (in place, its definitions kept for references into it) as a schema no value satisfies."""
    for key in [k for k in s if k in _ASSERTING]:
        del s[key]
    s["enum"] = []
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
_LOWER = {"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"}
_UPPER = {"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"}
_SUBSCHEMA = {"items", "additionalProperties", "propertyNames", "contains", "unevaluatedProperties"}


def _both(a: Any, b: Any) -> Any:
    """A subschema that holds where both do."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    return {"allOf": [a, b]}


def _merge_keyword(key: str, a: Any, b: Any) -> Any:
    """One keyword of two allOf parts as one keyword, or _CLASH where no single keyword says both."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if key in _LOWER and numbers:
        return max(a, b)
    if key in _UPPER and numbers:
        return min(a, b)
    if key == "required" and isinstance(a, list) and isinstance(b, list):
        return list(dict.fromkeys(a + b))
    if key in ("properties", "patternProperties") and isinstance(a, dict) and isinstance(b, dict):
        return {**a, **b, **{k: _both(a[k], b[k]) for k in a.keys() & b.keys()}}
    if key in _SUBSCHEMA:
        return _both(a, b)
    if key == "type":
        ta, tb = ({t} if isinstance(t, str) else set(t) for t in (a, b))
        both = (ta & tb) | ({"integer"} if ("integer" in ta and "number" in tb) or ("number" in ta and "integer" in tb)
                            else set())
        if not both:
            return _CLASH
        return both.pop() if len(both) == 1 else sorted(both)
    if key == "not":
        return {"anyOf": [a, b]}  # not A and not B: neither
    if key == "enum" and isinstance(a, list) and isinstance(b, list):
        keep = [v for v in a if any(json.dumps(v, sort_keys=True) == json.dumps(w, sort_keys=True) for w in b)]
        return keep or _CLASH
    return _CLASH


# keywords the walk renames (one_of, normalize): a pointer into one schema, read in the other
_RENAMED = {"anyOf": "oneOf", "oneOf": "anyOf", "prefixItems": "items", "items": "prefixItems"}


def _lookup(root: Any, pointer: str) -> Any:
    """The node a local JSON pointer ('#/a/0') names in `root`, or None."""
    if not pointer.startswith("#"):
        return None
    node = root
    for part in [p for p in pointer[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part not in node and part in _RENAMED and _RENAMED[part] in node:
            part = _RENAMED[part]
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _required_names(s: Any) -> list[str] | None:
    """The names an object schema of only `required` (and properties, type object) requires."""
    if not isinstance(s, dict):
        return None
    keys = set(s) - _ANNOTATIONS
    if "required" not in keys or not keys <= {"required", "properties", "type"} or s.get("type", "object") not in (
            "object", ["object"]) or not isinstance(s["required"], list):
        return None
    return list(s["required"]) or None


def _search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:  # an ECMA-only construct: a pattern Python cannot read matches nothing here
        return False


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _values(s: Any) -> set[str] | None:
    """The finite set of values a subschema allows (as JSON text), if it pins them."""
    if isinstance(s, dict):
        if "const" in s:
            return {json.dumps(s["const"], sort_keys=True)}
        if isinstance(s.get("enum"), list):
            return {json.dumps(v, sort_keys=True) for v in s["enum"]}
    return None


def _type_of(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v.is_integer() else "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _is_noop(key: str, value: Any) -> bool:
    """Keywords whose given value constrains nothing."""
    return (key in ("uniqueItems",) and value is False) or (key == "minProperties" and value == 0) or \
        (key in ("minItems", "minLength") and value == 0) or key in ("then", "else") or \
        (key in ("dependencies", "dependentRequired", "dependentSchemas") and not value)
