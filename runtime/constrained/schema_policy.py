"""Which JSON-schema keywords a grammar backend really enforces, and a schema rewritten for it.

Both backends silently drop keywords they cannot turn into a grammar (measured: xgrammar
ignores `uniqueItems`, `not`, `if`, `contains`, multi-part `allOf`, and treats `oneOf` as
`anyOf`; outlines-core also ignores numeric bounds). A dropped keyword means output that
does not validate, so `prepare_schema` walks every subschema reachable from the root and
raises `GrammarError` naming each keyword it cannot enforce, with its JSON pointer.

Rewrites that keep the meaning exactly:
- `oneOf` becomes `anyOf` when its branches are provably disjoint (different JSON types,
  different `const`/`enum` values of a property both require, or a property one requires
  and the other forbids), since then "exactly one" and "at least one" agree;
- `allOf` is merged into its parent when the parts constrain different keywords;
- draft-4 boolean `exclusiveMinimum`/`exclusiveMaximum` become the numeric form;
- tuple `items: [...]` (drafts 4-7) becomes `prefixItems` (+ `additionalItems` as `items`);
- an object schema naming no properties admits any (the backends would otherwise allow only `{}`);
- a `format` the backend enforces only approximately becomes an exact `pattern` (formats.py), and a
  format no validator asserts (`"format": "binary"`) is dropped, as validators ignore it.

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
from plait.runtime.constrained.formats import EXACT

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
    "xgrammar": _COMMON | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                           "propertyNames", "patternProperties", "maxProperties", "unevaluatedProperties"},
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


def prepare_schema(schema: Any, backend: str) -> dict | bool:
    """The schema rewritten for `backend`; GrammarError lists every keyword it cannot enforce."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json_schema must be a JSON object")
    schema = copy.deepcopy(schema)
    walker = _Walker(schema, backend)
    walker.visit(schema, "#")
    if walker.problems:
        shown = "; ".join(walker.problems[:8]) + (f"; and {len(walker.problems) - 8} more" if len(walker.problems) > 8 else "")
        raise GrammarError(f"json_schema uses what the {backend} backend cannot enforce: {shown}")
    return schema


class _Walker:
    def __init__(self, root: Any, backend: str):
        self.root = root
        self.backend = backend
        self.supported = _SUPPORTED[backend]
        self.problems: list[str] = []
        self.seen: set[int] = set()

    def bad(self, ptr: str, what: str) -> None:
        self.problems.append(f"{what} at {ptr}")

    def resolve(self, ref: str, ptr: str) -> Any:
        if not ref.startswith("#"):
            self.bad(ptr, f"$ref {ref!r} (only local '#/...' references are resolved)")
            return None
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                self.bad(ptr, f"$ref {ref!r} that does not resolve")
                return None
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
        self.infer_type(s, ptr)
        self.exact_format(s)
        if s.get("uniqueItems") is False or (s.get("uniqueItems") and s.get("maxItems", 2) <= 1):
            s.pop("uniqueItems")
        if "minProperties" in s and s["minProperties"] <= len(set(s.get("required") or [])):
            s.pop("minProperties")  # implied by required
        if "allOf" in s:
            self.merge_all_of(s, ptr)
        if "oneOf" in s:
            branches = s["oneOf"]
            if isinstance(branches, list) and self.disjoint(branches):
                s.setdefault("anyOf", [])
                if s["anyOf"]:
                    self.bad(f"{ptr}/oneOf", "'oneOf' beside 'anyOf'")
                s["anyOf"] = s.pop("oneOf")
            else:
                s.pop("oneOf")
                self.bad(f"{ptr}/oneOf", "'oneOf' whose branches may overlap (exactly-one cannot be enforced)")
        self.required_into_properties(s, ptr)
        if s.get("type") in ("object", ["object"]):
            if not any(k in s for k in ("properties", "patternProperties", "additionalProperties",
                                        "unevaluatedProperties", "propertyNames")):
                s["additionalProperties"] = True

    def exact_format(self, s: dict) -> None:
        """Drop a format no validator asserts; make one the backend enforces only approximately an
        exact pattern (left in place, and refused, where the backend cannot take that pattern)."""
        fmt = s.get("format")
        if not isinstance(fmt, str) or fmt in _FORMATS[self.backend]:
            return
        if fmt not in _ASSERTED_FORMATS:
            s.pop("format")
            return
        if fmt not in EXACT or "pattern" in s:
            return
        pattern, max_length = EXACT[fmt]
        if max_length is not None and self.backend not in _LENGTHS_WITH_PATTERN:
            return
        s.pop("format")
        s["pattern"] = f"^{pattern}$"
        if max_length is not None:
            s["maxLength"] = min(max_length, s.get("maxLength", max_length))

    def required_into_properties(self, s: dict, ptr: str) -> None:
        """Backends enforce `required` only for names listed in `properties`; list the others
        with the schema JSON Schema gives them (additionalProperties, or anything)."""
        missing = [k for k in s.get("required") or [] if k not in (s.get("properties") or {})]
        if not missing:
            return
        extra = s.get("additionalProperties", True)
        for key in missing:
            if any(re.search(p, key) for p in s.get("patternProperties") or {}):
                self.bad(f"{ptr}/required", f"required name {key!r} matched by patternProperties")
            elif extra is False:
                self.bad(f"{ptr}/required", f"required name {key!r} that additionalProperties forbids")
            else:
                s.setdefault("properties", {})[key] = {} if extra is True else copy.deepcopy(extra)

    def infer_type(self, s: dict, ptr: str) -> None:
        """Type keywords apply only to their type: `{"minLength": 2}` also admits 5. Backends
        ignore them without a `type`, so one family pins the type (narrower, still valid output)
        and several at once are refused."""
        if "type" in s or "const" in s or "enum" in s or "$ref" in s:
            return
        families = {t for t, keys in _FAMILIES.items() if any(k in s for k in keys)}
        if len(families) == 1:
            s["type"] = families.pop()
        elif len(families) > 1:
            self.bad(ptr, f"keywords of several types ({', '.join(sorted(families))}) without 'type'")

    def merge_all_of(self, s: dict, ptr: str) -> None:
        parts = s.pop("allOf")
        if not isinstance(parts, list):
            self.bad(f"{ptr}/allOf", "'allOf' that is not a list")
            return
        for i, part in enumerate(parts):
            if part is True:
                continue
            if not isinstance(part, dict):
                self.bad(f"{ptr}/allOf/{i}", "'allOf' with a false part")
                continue
            if "$ref" in part and len([k for k in part if k not in _ANNOTATIONS]) == 1:
                target = self.resolve(part["$ref"], f"{ptr}/allOf/{i}")
                if not isinstance(target, dict) or "$ref" in target:
                    self.bad(f"{ptr}/allOf/{i}", "'allOf' of a reference that cannot be merged")
                    continue
                part = copy.deepcopy(target)
            clash = [k for k in part if k in _ASSERTING and k in s and s[k] != part[k]]
            if clash:
                self.bad(f"{ptr}/allOf/{i}", f"'allOf' whose parts both constrain {clash}")
                continue
            s.update({k: v for k, v in part.items() if k in _ASSERTING})

    # ---- oneOf disjointness -----------------------------------------------------------------
    def deref(self, s: Any) -> Any:
        for _ in range(16):
            if isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
                nxt = self.resolve(s["$ref"], "#")
                if nxt is None:
                    return s
                s = nxt
            else:
                break
        return s

    def types(self, s: Any) -> set[str]:
        s = self.deref(s)
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
            out = set().union(*(self.types(b) for b in (s.get("anyOf") or s.get("oneOf") or [])))
        else:
            out = set(_JSON_TYPES)
        if "integer" in out or "number" in out:  # 1 is both an integer and a number
            out |= {"integer", "number"}
        return out

    def disjoint(self, branches: list) -> bool:
        resolved = [self.deref(b) for b in branches]
        for i in range(len(resolved)):
            for j in range(i + 1, len(resolved)):
                if not self.pair_disjoint(resolved[i], resolved[j]):
                    return False
        return True

    def pair_disjoint(self, a: Any, b: Any) -> bool:
        if a is False or b is False:
            return True
        if not self.types(a) & self.types(b):
            return True
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return False
        if "const" in a and "const" in b and a["const"] != b["const"]:
            return True
        for x, y in ((a, b), (b, a)):
            for key in x.get("required") or []:
                xp = self.deref((x.get("properties") or {}).get(key))
                yp = self.deref((y.get("properties") or {}).get(key))
                if key in (y.get("required") or []) and _values(xp) is not None and _values(yp) is not None:
                    if not _values(xp) & _values(yp):
                        return True
                if (y.get("additionalProperties") is False and key not in (y.get("properties") or {})
                        and not y.get("patternProperties")):
                    return True
        return False


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
