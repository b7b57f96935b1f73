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
- tuple `items: [...]` (drafts 4-7) becomes `prefixItems` (+ `additionalItems` as `items`), and what
  stands beside a `$ref` in drafts 3-7 is dropped (those drafts ignore it);
- `$ref` to a plain-name anchor becomes a JSON pointer, and so does a `$dynamicRef` in a schema of one
  resource; `not: {}` admits nothing, and a `true` patternProperty nothing looks at is dropped;
- a pattern opening with a negative lookahead of literal prefixes becomes two patterns without lookaround
  (lookahead.py), for a backend that intersects them;
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
from typing import Any

from plait.runtime.constrained.base import GrammarError
from plait.runtime.constrained.closed_objects import close_objects
from plait.runtime.constrained.formats import EXACT, KNOWN_ANNOTATIONS, NARROWER, NUMBER_FORMATS, SUBFORMAT
from plait.runtime.constrained.lookahead import split_negative_prefixes
from plait.runtime.constrained.schema_branches import Branches
from plait.runtime.constrained.schema_keywords import (ANNOTATIONS, ASSERTED_FORMATS, ASSERTING, COUNTS, FAMILIES,
                                                       FORMATS, LENGTHS_WITH_PATTERN, CLAMPED_BOUND, CLAMPED_BOUNDS, LOWER, PATTERNS_INTERSECTED,
                                                       SIBLINGS_WITH_ANYOF, SUPPORTED, TRUSTED_PATTERNS,
                                                       UNEVALUATED_BLOCKERS, UNTRUSTED_PATTERNS, conjunction, is_noop,
                                                       is_number, lookup, make_impossible, search, type_of)
from plait.runtime.constrained.schema_merge import Merging
from plait.runtime.constrained.schema_narrowing import Narrowing
from plait.runtime.constrained.schema_refs import (LEGACY_DRAFT, anchors_as_pointers, drop_ids, plain_refs,
                                                   recursive_refs, refs_alone)


def prepare_schema(schema: Any, backend: str, narrow: bool = True) -> dict | bool:
    """The schema rewritten for `backend`; GrammarError lists every keyword it cannot enforce. With
    `narrow`, a keyword no backend enforces exactly may be replaced by a stricter one (a narrowing)."""
    return rewrite_schema(schema, backend, narrow)[0]


def rewrite_schema(schema: Any, backend: str, narrow: bool = True) -> tuple[dict | bool, tuple[str, ...]]:
    """prepare_schema's schema, and the narrowings it applied (each said where)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json_schema must be a JSON object")
    schema = json_copy(schema)
    if isinstance(schema, dict) and LEGACY_DRAFT.search(str(schema.get("$schema", ""))):
        refs_alone(schema)
    anchors_as_pointers(schema)
    recursive_refs(schema)
    plain_refs(schema)
    walker = _Walker(schema, backend, narrow)
    walker.visit(schema, "#")
    if walker.impossible(schema):
        walker.problems.insert(0, f"a schema that needs what {walker.remote[0]!r} names (another document: plait "
                               "fetches none) at #" if walker.remote else
                               "a schema that no value satisfies (its types, values or required parts clash) at #")
    if walker.problems:
        shown = "; ".join(walker.problems[:8]) + (f"; and {len(walker.problems) - 8} more" if len(walker.problems) > 8 else "")
        raise GrammarError(f"json_schema uses what the {backend} backend cannot enforce: {shown}")
    close_objects(schema, lambda ref: lookup(schema, ref))
    if isinstance(schema, dict):
        # the rewrite speaks draft 2020-12 (tuple `items` became `prefixItems`): a backend told the sender's
        # older draft would read `prefixItems` as an unknown word and let any item through
        schema.pop("$schema", None)
    drop_ids(schema)
    return schema, tuple(dict.fromkeys(walker.narrowed))


def json_copy(data: Any) -> Any:
    """A deep copy of JSON data, through its text: several times faster than copy.deepcopy on a big schema."""
    return json.loads(json.dumps(data))


def _anything(sub: Any) -> bool:
    """A subschema that admits every value: `true`, or only annotations."""
    return sub is True or (isinstance(sub, dict) and not set(sub) - ANNOTATIONS)


class _Walker(Branches, Narrowing, Merging):
    """One walk over a schema: refuses, rewrites and narrows it in place; the mixins hold the jobs by kind."""


    def __init__(self, root: Any, backend: str, narrow: bool = True):
        self.root = root
        self.original = json_copy(root)  # the walk rewrites root in place
        self.narrowed: list[str] = []  # each narrowing, said where
        self.narrower = False  # some subschema admits less than it did (a narrowing, a pinned type)
        # id(schema) -> (the schema, where its oneOf came from: a merged allOf part)
        self.origins: dict[int, tuple[dict, str]] = {}
        self.backend = backend
        self.narrow = narrow
        self.supported = SUPPORTED[backend]
        self.problems: list[str] = []
        self.seen: dict[int, Any] = {}  # id -> the subschema visited (kept alive: its id names no other)
        self.one_ofs: dict[str, list] | None = None  # Branches.sent_one_ofs
        self.checker = None  # Branches.validator
        self.original_ids: set[int] | None = None  # Branches.sent_ids
        self.admitted: dict[tuple[int, str], bool] = {}  # Branches.admits of the schema as sent
        self.remote: list[str] = []  # references to other documents, taken as admitting no value (unfetched)
        # 2020-12's format-assertion vocabulary asked for: an unknown format is refused, not ignored
        vocabulary = root.get("$vocabulary") if isinstance(root, dict) else None
        self.assert_formats = isinstance(vocabulary, dict) and any(
            "format-assertion" in str(k) and v for k, v in vocabulary.items())

    def unfetched(self, ref: Any, ptr: str) -> bool:
        """A reference to another document (plait fetches none): with narrowing, taken as admitting no value, so
        an anyOf branch or an optional property it names is left out (each value written is then one it cannot
        refuse); where it is required, the schema is refused naming it."""
        if not isinstance(ref, str) or ref.startswith("#") or not self.narrow:
            return False
        self.remote.append(ref)
        self.note(ptr, f"$ref {ref!r} (another document, not fetched) as no value")
        return True

    def bad(self, ptr: str, what: str) -> None:
        self.problems.append(f"{what} at {ptr}")

    def resolve(self, ref: str, ptr: str, root: Any = None) -> Any:
        """The subschema `ref` points to, in the schema being rewritten (or in `root`)."""
        if not ref.startswith("#"):
            self.bad(ptr, f"$ref {ref!r} (only local '#/...' references are resolved)")
            return None
        node = lookup(self.root if root is None else root, ref)
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
        self.seen[id(s)] = s
        self.normalize(s, ptr)
        for key in list(s):
            if key not in ASSERTING:
                continue
            if key not in self.supported:
                if not is_noop(key, s[key]):
                    self.bad(f"{ptr}/{key}", f"keyword {key!r}")
                continue
        if (self.backend not in LENGTHS_WITH_PATTERN and ("pattern" in s or "format" in s)
                and ("minLength" in s or "maxLength" in s)):
            self.bad(ptr, f"minLength/maxLength beside pattern or format (the {self.backend} backend drops one)")
        self.exact_format(s, ptr)  # again: an allOf merged since may have brought a format
        fmt = s.get("format")
        if isinstance(fmt, str) and fmt not in FORMATS[self.backend]:
            self.bad(f"{ptr}/format", f"format {fmt!r}")
        if self.backend in UNTRUSTED_PATTERNS and "pattern" in s and s["pattern"] not in TRUSTED_PATTERNS:
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
                return make_impossible(s)
            s["anyOf"] = kept
        props = s.get("properties")
        for name, sub in list(props.items()) if isinstance(props, dict) else []:
            if sub is False or not self.impossible(sub):
                continue
            if name in (s.get("required") or []):
                return make_impossible(s)
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
                return make_impossible(s)

    def impossible(self, sub: Any) -> bool:
        """Whether a (visited) subschema admits no value, as far as its own keywords say."""
        sub = self.deref(sub)
        return sub is False or (isinstance(sub, dict) and sub.get("enum") == [])

    def normalize(self, s: dict, ptr: str) -> None:
        if self.unfetched(s.get("$ref"), ptr):
            return make_impossible(s)
        for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(s.get(bound), bool):  # draft 4: a flag on minimum/maximum
                if s.pop(bound) and plain in s:
                    s[bound] = s.pop(plain)
        if isinstance(s.get("items"), list):  # drafts 4-7 tuple form
            s["prefixItems"] = s.pop("items")
            s["items"] = s.pop("additionalItems", True)
        elif "additionalItems" in s:
            s.pop("additionalItems")  # without tuple items it has no effect
        for key in COUNTS:  # 2.0 is a count too (llguidance wants an integer)
            if isinstance(s.get(key), float) and s[key].is_integer():
                s[key] = int(s[key])
        if "not" in s and (s["not"] is False or _anything(s["not"])):
            if s.pop("not") is not False:  # not of anything: nothing (an optional property so marked is absent)
                make_impossible(s)
        patterns = s.get("patternProperties")
        if isinstance(patterns, dict) and s.get("additionalProperties", True) is True \
                and "unevaluatedProperties" not in s:
            for key in [k for k, v in patterns.items() if _anything(v)]:
                del patterns[key]  # admits anything, and no additionalProperties or unevaluatedProperties looks at it
            if not patterns:
                s.pop("patternProperties")
        split = split_negative_prefixes(s["pattern"]) if isinstance(s.get("pattern"), str) else None
        if split and self.may_add_pattern(s):  # no lookaround: two patterns, intersected
            s["pattern"] = split[0]
            self.add_pattern(s, split[1])
        self.exact_format(s, ptr)  # before infer_type: an unknown format says nothing of the type, int32 a number
        self.infer_type(s, ptr)
        self.values_of_type(s)
        if self.backend in CLAMPED_BOUNDS and self.narrow:
            self.clamp_bounds(s, ptr)
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
        if s.get("anyOf") and self.backend not in SIBLINGS_WITH_ANYOF:
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
        if any(k in s for k in UNEVALUATED_BLOCKERS):
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
            if not isinstance(b, dict) or any(k in b for k in UNEVALUATED_BLOCKERS | {"anyOf", "oneOf"}):
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
            if plain not in part and any(k in part for k in UNEVALUATED_BLOCKERS | {"anyOf", "oneOf", "contains"}):
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
        elif not any(k in s for k in UNEVALUATED_BLOCKERS | {"anyOf", "oneOf", "contains"}):
            s["items"] = s.pop("unevaluatedItems")

    def siblings_into_branches(self, s: dict) -> None:
        """A + anyOf [B1, B2] as anyOf [A + B1, A + B2] (exact), for backends that drop what stands
        beside an anyOf (measured: xgrammar takes the branches alone, so a parent's bounds, properties
        and required names were lost)."""
        siblings = {k: s.pop(k) for k in list(s) if k in ASSERTING and k != "anyOf"}
        if siblings:  # less the branches no instance of the siblings can satisfy
            branches = [b for b in s["anyOf"] if not self.pair_disjoint(siblings, b)] or s["anyOf"]
            s["anyOf"] = [{"allOf": [copy.deepcopy(siblings), branch]} for branch in branches]

    def exact_format(self, s: dict, ptr: str) -> None:
        """Drop a format no validator asserts; make one the backend enforces only approximately an
        exact pattern (left in place, and refused, where the backend cannot take that pattern)."""
        fmt = s.get("format")
        if not isinstance(fmt, str) or fmt in FORMATS[self.backend]:
            return
        if fmt in NUMBER_FORMATS:  # OpenAPI's: the range of the machine type, as bounds (they bind numbers only)
            s.pop("format")
            low, high = NUMBER_FORMATS[fmt]
            s["minimum"] = max(low, s.get("minimum", low)) if is_number(s.get("minimum", low)) else low
            s["maximum"] = min(high, s.get("maximum", high)) if is_number(s.get("maximum", high)) else high
            if self.backend in CLAMPED_BOUNDS and self.narrow:
                self.clamp_bounds(s, ptr)
            return
        if fmt not in ASSERTED_FORMATS:
            if self.assert_formats:  # the schema's vocabulary makes formats assertions: one unknown is refused
                return
            s.pop("format")  # an annotation: validators ignore a format they do not know
            if fmt not in KNOWN_ANNOTATIONS:
                self.narrowed.append(f"format {fmt!r} ignored (an annotation: no validator asserts it) at {ptr}")
            return
        if self.narrow and fmt in SUBFORMAT and self.enforceable(SUBFORMAT[fmt], s):
            self.note(ptr, f"format {fmt!r} as {SUBFORMAT[fmt]!r}")
            s["format"] = fmt = SUBFORMAT[fmt]
            if fmt in FORMATS[self.backend]:
                return
        if self.narrow and fmt in NARROWER and self.may_add_pattern(s) and (
                self.backend in LENGTHS_WITH_PATTERN or not ("minLength" in s or "maxLength" in s)):
            s.pop("format")
            self.add_pattern(s, f"^{NARROWER[fmt]}$")
            self.note(ptr, f"format {fmt!r} as the pattern {'^' + NARROWER[fmt] + '$'!r}")
            return
        if fmt not in EXACT or not self.may_add_pattern(s):
            return
        pattern, max_length = EXACT[fmt]
        if max_length is not None and self.backend not in LENGTHS_WITH_PATTERN:
            return
        s.pop("format")
        self.add_pattern(s, f"^{pattern}$")
        if max_length is not None:
            s["maxLength"] = min(max_length, s.get("maxLength", max_length))

    def may_add_pattern(self, s: dict) -> bool:
        return "pattern" not in s or self.backend in PATTERNS_INTERSECTED

    def add_pattern(self, s: dict, pattern: str) -> None:
        """`pattern` beside the one `s` may have: both must match (an allOf of patterns, which llguidance
        intersects)."""
        if "pattern" not in s or s["pattern"] == pattern:
            s["pattern"] = pattern
        else:
            s.setdefault("allOf", []).append({"pattern": pattern})

    def enforceable(self, fmt: str, s: dict) -> bool:
        """The backend enforces `fmt` natively or as formats.EXACT's pattern, beside what `s` has."""
        if fmt in FORMATS[self.backend]:
            return True
        return fmt in EXACT and self.may_add_pattern(s) and (
            self.backend in LENGTHS_WITH_PATTERN or (EXACT[fmt][1] is None and not ("minLength" in s or "maxLength" in s)))

    def required_into_properties(self, s: dict, ptr: str) -> None:
        """Backends enforce `required` only for names listed in `properties`; list the others
        with the schema JSON Schema gives them (additionalProperties, or anything)."""
        missing = [k for k in s.get("required") or [] if k not in (s.get("properties") or {})]
        if not missing:
            return
        extra = s.get("additionalProperties", True)
        for key in missing:
            matched = [sub for p, sub in (s.get("patternProperties") or {}).items() if search(p, key)]
            if matched:  # every pattern that matches the name applies to its value (and additionalProperties not)
                merged = copy.deepcopy(matched[0])
                for sub in matched[1:]:
                    merged = conjunction(merged, copy.deepcopy(sub))
                s.setdefault("properties", {})[key] = merged
            elif extra is False:
                self.bad(f"{ptr}/required", f"required name {key!r} that additionalProperties forbids")
            else:
                s.setdefault("properties", {})[key] = {} if extra is True else copy.deepcopy(extra)

    def clamp_bounds(self, s: dict, ptr: str) -> None:
        """Numeric bounds at 64-bit's edge (Java's Long.MIN_VALUE, OpenAPI's int64) within +-2**62: llguidance
        cannot build the range's regex beyond (measured: -2**63 fails, -2**62 compiles), xgrammar refuses bounds past
        int64 as a double (OpenAPI's float)."""
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            value = s.get(key)
            if is_number(value) and abs(value) > CLAMPED_BOUND:
                s[key] = CLAMPED_BOUND if value > 0 else -CLAMPED_BOUND
                if (value > 0) == (key in LOWER):  # a bound raised or lowered past it: nothing is left between
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
        of_type = lambda v: type_of(v) in allowed or (type_of(v) == "integer" and "number" in allowed)  # noqa: E731
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
        families = {t for t, keys in FAMILIES.items() if any(k in s for k in keys)}
        if len(families) == 1:
            s["type"] = families.pop()
            self.narrower = True
        elif len(families) > 1 and "anyOf" not in s:
            # each family's keywords bind its own type only: one branch per type (exact)
            branches = [{"type": t, **{k: s.pop(k) for k in FAMILIES[t] if k in s}} for t in sorted(families)]
            rest = sorted({"object", "array", "string", "number", "boolean", "null"} - families)
            s["anyOf"] = branches + ([{"type": rest}] if rest else [])
        elif len(families) > 1:
            self.bad(ptr, f"keywords of several types ({', '.join(sorted(families))}) without 'type'")

    # ---- narrowings: a stricter schema where no backend enforces the keyword itself ----------------
    def note(self, ptr: str | None, what: str) -> None:
        self.narrower = True
        if ptr is not None:  # None: a trial (closed_object), kept or dropped by its caller
            self.narrowed.append(f"{what} at {ptr}")

