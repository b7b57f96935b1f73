"""The JSON-schema vocabulary the schema policy works with: which keywords each backend enforces, the
keyword families, and small helpers over schemas (a pointer lookup, a value's JSON type, the names a schema
requires, the values it pins)."""

from __future__ import annotations

import json
import re
from typing import Any

from plait.runtime.constrained.formats import EXACT, NARROWER

# keywords with no effect on validity
ANNOTATIONS = {
    "$schema", "$id", "id", "$comment", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "$anchor", "contentMediaType", "contentEncoding", "nullable", "markdownDescription",
    "deprecationMessage", "errorMessage", "enumDescriptions", "markdownEnumDescriptions", "x-intellij-html-description",
    "defaultSnippets", "$vocabulary", "definitions", "$defs", "discriminator", "example", "externalDocs", "xml",
}
# every keyword JSON Schema gives an assertion or applicator meaning (drafts 4 to 2020-12); any
# other key is an annotation or an extension, which validators ignore, and so do we
ASSERTING = {
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
SUPPORTED = {
    # (xgrammar's own propertyNames leaves the names in `properties` unchecked: names_as_properties)
    # (measured: xgrammar's own unevaluatedProperties ignores names an anyOf branch or a nested allOf lists)
    "xgrammar": _COMMON | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                           "patternProperties", "maxProperties"},
    "llguidance": _COMMON | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                             "patternProperties", "minProperties", "maxProperties"},
    "outlines": _COMMON | {"minProperties"},
}
# formats jsonschema's format checker asserts, and which of them each backend enforces
ASSERTED_FORMATS = {"email", "idn-email", "date", "date-time", "time", "duration", "uri", "uri-reference", "iri",
                     "iri-reference", "uri-template", "ipv4", "ipv6", "hostname", "idn-hostname", "uuid", "regex",
                     "json-pointer", "relative-json-pointer"}
# (each one checked against jsonschema's format checker on edge cases: tests/test_structured.py); the
# others of formats.EXACT become patterns, where the backend takes them
FORMATS = {
    "xgrammar": {"email", "duration", "uri", "uri-reference", "ipv6", "uuid"},
    "llguidance": {"email", "duration", "uri", "ipv4", "ipv6", "uuid"},
    "outlines": {"email", "uri", "uuid"},
}
# measured: xgrammar admits "2.0" for ^(0|[1-9]\d*)(?:\+([0-9a-z]+(?:\.[0-9a-z]+)*))?$ (a semver pattern
# from the corpus), so it takes only the patterns written here (formats.py), checked on edge cases
UNTRUSTED_PATTERNS = {"xgrammar"}
TRUSTED_PATTERNS = {f"^{p}$" for p, _ in EXACT.values()} | {f"^{p}$" for p in NARROWER.values()}
# backends that take an allOf of patterns (llguidance intersects the regexes)
PATTERNS_INTERSECTED = {"llguidance"}
# backends that enforce what stands beside an anyOf (the others get it copied into each branch)
SIBLINGS_WITH_ANYOF = {"llguidance"}
# backends that enforce minLength/maxLength beside a pattern or format (xgrammar drops the lengths,
# outlines-core the pattern)
LENGTHS_WITH_PATTERN = {"llguidance"}
FAMILIES = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "additionalItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
               "minProperties", "maxProperties", "dependentRequired", "unevaluatedProperties", "dependencies"),
}
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}




CLASH = object()
# in-place applicators whose evaluated names or items the unevaluated* rewrites do not follow
UNEVALUATED_BLOCKERS = {"$ref", "allOf", "if", "then", "else", "dependentSchemas", "not", "$dynamicRef",
                         "$recursiveRef"}
CLAMPED_BOUND = 2 ** 62
CLAMPED_BOUNDS = {"llguidance", "xgrammar"}  # backends whose bounds clamp_bounds keeps within CLAMPED_BOUND
# (A1 or A2) and (B1 or B2) becomes every pair of branches: at most this many (the grammar grows with each)
MAX_BRANCH_PAIRS = 32
NOT_MERGED_INTO_BRANCHES = {"anyOf", "oneOf", "allOf", "if", "then", "else", "not", "$ref"}


def make_impossible(s: dict) -> None:
    """`s` (in place, its definitions kept for references into it) as a schema no value satisfies."""
    for key in [k for k in s if k in ASSERTING]:
        del s[key]
    s["enum"] = []
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
LOWER = {"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"}
_UPPER = {"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"}
_SUBSCHEMA = {"items", "additionalProperties", "propertyNames", "contains", "unevaluatedProperties"}


def conjunction(a: Any, b: Any) -> Any:
    """A subschema that holds where both do."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    return {"allOf": [a, b]}


def merge_keyword(key: str, a: Any, b: Any) -> Any:
    """One keyword of two allOf parts as one keyword, or CLASH where no single keyword says both."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if key in LOWER and numbers:
        return max(a, b)
    if key in _UPPER and numbers:
        return min(a, b)
    if key == "required" and isinstance(a, list) and isinstance(b, list):
        return list(dict.fromkeys(a + b))
    if key in ("properties", "patternProperties") and isinstance(a, dict) and isinstance(b, dict):
        return {**a, **b, **{k: conjunction(a[k], b[k]) for k in a.keys() & b.keys()}}
    if key in _SUBSCHEMA:
        return conjunction(a, b)
    if key == "type":
        ta, tb = ({t} if isinstance(t, str) else set(t) for t in (a, b))
        both = (ta & tb) | ({"integer"} if ("integer" in ta and "number" in tb) or ("number" in ta and "integer" in tb)
                            else set())
        if not both:
            return CLASH
        return both.pop() if len(both) == 1 else sorted(both)
    if key == "not":
        return {"anyOf": [a, b]}  # not A and not B: neither
    if key == "enum" and isinstance(a, list) and isinstance(b, list):
        keep = [v for v in a if any(json.dumps(v, sort_keys=True) == json.dumps(w, sort_keys=True) for w in b)]
        return keep or CLASH
    return CLASH


# keywords the walk renames (one_of, normalize): a pointer into one schema, read in the other
_RENAMED = {"anyOf": "oneOf", "oneOf": "anyOf", "prefixItems": "items", "items": "prefixItems"}


def lookup(root: Any, pointer: str) -> Any:
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


def required_names(s: Any) -> list[str] | None:
    """The names an object schema of only `required` (and properties, type object) requires."""
    if not isinstance(s, dict):
        return None
    keys = set(s) - ANNOTATIONS
    if "required" not in keys or not keys <= {"required", "properties", "type"} or s.get("type", "object") not in (
            "object", ["object"]) or not isinstance(s["required"], list):
        return None
    return list(s["required"]) or None


def search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:  # an ECMA-only construct: a pattern Python cannot read matches nothing here
        return False


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def pinned_values(s: Any) -> set[str] | None:
    """The finite set of values a subschema allows (as JSON text), if it pins them."""
    if isinstance(s, dict):
        if "const" in s:
            return {json.dumps(s["const"], sort_keys=True)}
        if isinstance(s.get("enum"), list):
            return {json.dumps(v, sort_keys=True) for v in s["enum"]}
    return None


def type_of(v: Any) -> str:
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


def is_noop(key: str, value: Any) -> bool:
    """Keywords whose given value constrains nothing."""
    return (key in ("uniqueItems",) and value is False) or (key == "minProperties" and value == 0) or \
        (key in ("minItems", "minLength") and value == 0) or key in ("then", "else") or \
        (key in ("dependencies", "dependentRequired", "dependentSchemas") and not value)
