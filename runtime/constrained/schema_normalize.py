"""Rewrites of one subschema that keep its meaning (and the narrowings of formats): the forms of older drafts
in 2020-12's, keywords that say nothing dropped, a format as an exact pattern, the type that type keywords
imply, `unevaluated*` as the `additional*` they amount to, required names listed in `properties`."""

from __future__ import annotations

import copy
import json
from typing import Any

from plait.runtime.constrained.formats import EXACT, KNOWN_ANNOTATIONS, NARROWER, NUMBER_FORMATS, SUBFORMAT
from plait.runtime.constrained.lookahead import split_negative_prefixes
from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_keywords import (ANNOTATIONS, ASSERTED_FORMATS, CLAMPED_BOUND, CLAMPED_BOUNDS,
                                                       COUNTS, FAMILIES, FORMATS, LENGTHS_WITH_PATTERN, LOWER,
                                                       UNEVALUATED_BLOCKERS, conjunction, is_number, make_impossible,
                                                       search, type_of)


def _anything(sub: Any) -> bool:
    """A subschema that admits every value: `true`, or only annotations."""
    return sub is True or (isinstance(sub, dict) and not set(sub) - ANNOTATIONS)


def normalize(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
    """Older drafts' forms in 2020-12's, keywords that say nothing dropped, a format as the pattern it means,
    the type keywords imply, enum/const values of the type only, bounds the backend can build."""
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
    if split and ctx.may_add_pattern(s):  # no lookaround: two patterns, intersected
        s["pattern"] = split[0]
        ctx.add_pattern(s, split[1])
    exact_format(ctx, s, ptr)  # before infer_type: an unknown format says nothing of the type, int32 a number
    infer_type(ctx, s, ptr)
    values_of_type(s)
    if ctx.backend in CLAMPED_BOUNDS and ctx.narrow:
        clamp_bounds(ctx, s, ptr)
    if s.get("uniqueItems") is False or (s.get("uniqueItems") and s.get("maxItems", 2) <= 1):
        s.pop("uniqueItems")
    if "minProperties" in s and s["minProperties"] <= len(set(s.get("required") or [])):
        s.pop("minProperties")  # implied by required
    listed = [n for n, sub in (s.get("properties") or {}).items() if sub is not False]
    if s.get("additionalProperties") is False and not s.get("patternProperties") \
            and s.get("maxProperties", len(listed)) >= len(listed):
        s.pop("maxProperties", None)  # cannot be exceeded


def exact_format(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
    """Drop a format no validator asserts; make one the backend enforces only approximately an
    exact pattern (left in place, and refused, where the backend cannot take that pattern)."""
    fmt = s.get("format")
    if not isinstance(fmt, str) or fmt in FORMATS[ctx.backend]:
        return
    if fmt in NUMBER_FORMATS:  # OpenAPI's: the range of the machine type, as bounds (they bind numbers only)
        s.pop("format")
        low, high = NUMBER_FORMATS[fmt]
        s["minimum"] = max(low, s.get("minimum", low)) if is_number(s.get("minimum", low)) else low
        s["maximum"] = min(high, s.get("maximum", high)) if is_number(s.get("maximum", high)) else high
        if ctx.backend in CLAMPED_BOUNDS and ctx.narrow:
            clamp_bounds(ctx, s, ptr)
        return
    if fmt not in ASSERTED_FORMATS:
        if ctx.assert_formats:  # the schema's vocabulary makes formats assertions: one unknown is refused
            return
        s.pop("format")  # an annotation: validators ignore a format they do not know
        if fmt not in KNOWN_ANNOTATIONS:
            ctx.narrowed.append(f"format {fmt!r} ignored (an annotation: no validator asserts it) at {ptr}")
        return
    if ctx.narrow and fmt in SUBFORMAT and enforceable(ctx, SUBFORMAT[fmt], s):
        ctx.note(ptr, f"format {fmt!r} as {SUBFORMAT[fmt]!r}")
        s["format"] = fmt = SUBFORMAT[fmt]
        if fmt in FORMATS[ctx.backend]:
            return
    if ctx.narrow and fmt in NARROWER and ctx.may_add_pattern(s) and (
            ctx.backend in LENGTHS_WITH_PATTERN or not ("minLength" in s or "maxLength" in s)):
        s.pop("format")
        ctx.add_pattern(s, f"^{NARROWER[fmt]}$")
        ctx.note(ptr, f"format {fmt!r} as the pattern {'^' + NARROWER[fmt] + '$'!r}")
        return
    if fmt not in EXACT or not ctx.may_add_pattern(s):
        return
    pattern, max_length = EXACT[fmt]
    if max_length is not None and ctx.backend not in LENGTHS_WITH_PATTERN:
        return
    s.pop("format")
    ctx.add_pattern(s, f"^{pattern}$")
    if max_length is not None:
        s["maxLength"] = min(max_length, s.get("maxLength", max_length))

def enforceable(ctx: SchemaRewrite, fmt: str, s: dict) -> bool:
    """The backend enforces `fmt` natively or as formats.EXACT's pattern, beside what `s` has."""
    if fmt in FORMATS[ctx.backend]:
        return True
    return fmt in EXACT and ctx.may_add_pattern(s) and (
        ctx.backend in LENGTHS_WITH_PATTERN or (EXACT[fmt][1] is None and not ("minLength" in s or "maxLength" in s)))

def infer_type(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
    """Type keywords apply only to their type: `{"minLength": 2}` also admits 5. Backends
    ignore them without a `type`, so one family pins the type (narrower, still valid output),
    and several become an anyOf of one branch per type (exact)."""
    if "type" in s or "const" in s or "enum" in s or "$ref" in s:
        return
    families = {t for t, keys in FAMILIES.items() if any(k in s for k in keys)}
    if len(families) == 1:
        s["type"] = families.pop()
        ctx.narrower = True
    elif len(families) > 1 and "anyOf" not in s:
        # each family's keywords bind its own type only: one branch per type (exact)
        branches = [{"type": t, **{k: s.pop(k) for k in FAMILIES[t] if k in s}} for t in sorted(families)]
        rest = sorted({"object", "array", "string", "number", "boolean", "null"} - families)
        s["anyOf"] = branches + ([{"type": rest}] if rest else [])
    elif len(families) > 1:
        ctx.bad(ptr, f"keywords of several types ({', '.join(sorted(families))}) without 'type'")

def values_of_type(s: dict) -> None:
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

def clamp_bounds(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
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
                ctx.note(ptr, f"{key} {value} as {s[key]}")

def own_unevaluated(ctx: SchemaRewrite, part: dict, where: str) -> bool:
    """An allOf part's unevaluated* as what they say within the part, before it is merged (the other
    parts' names and items do not count as evaluated for it); False where that cannot be said."""
    for key, plain in (("unevaluatedProperties", "additionalProperties"), ("unevaluatedItems", "items")):
        if key not in part:
            continue
        if plain not in part and any(k in part for k in UNEVALUATED_BLOCKERS | {"anyOf", "oneOf", "contains"}):
            ctx.bad(where, f"'allOf' part with {key!r} beside an applicator")
            return False
        extra = part.pop(key)
        part.setdefault(plain, extra)
    return True

def unevaluated_properties(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
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
    if len(branches) > 1 and not ctx.narrow:
        return  # refused by name
    closed = []
    for branch in branches:
        b = ctx.deref(branch)
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
        ctx.note(ptr, "unevaluatedProperties beside anyOf as each branch closed over its own names")

def unevaluated_items(s: dict) -> None:
    """`unevaluatedItems` as the `items` it amounts to, where nothing but prefixItems evaluates items
    (exact); left in place, and refused by name, beside an applicator or contains."""
    extra = s["unevaluatedItems"]
    if extra is True or extra == {} or "items" in s:
        s.pop("unevaluatedItems")
    elif not any(k in s for k in UNEVALUATED_BLOCKERS | {"anyOf", "oneOf", "contains"}):
        s["items"] = s.pop("unevaluatedItems")

def required_into_properties(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
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
            ctx.bad(f"{ptr}/required", f"required name {key!r} that additionalProperties forbids")
        else:
            s.setdefault("properties", {})[key] = {} if extra is True else copy.deepcopy(extra)


def finish_object(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
    """An object schema as the backends read it: required names listed in properties, absent names dropped where
    xgrammar would refuse `false` and unlisted names are forbidden anyway, an object naming nothing open."""
    required_into_properties(ctx, s, ptr)
    absent = [n for n, sub in (s.get("properties") or {}).items() if sub is False]
    if absent and ctx.backend == "xgrammar" and s.get("additionalProperties") is False \
            and not s.get("patternProperties") and not set(absent) & set(s.get("required") or []):
        for name in absent:  # xgrammar refuses a `false` schema; unlisted, the name is forbidden anyway
            del s["properties"][name]
    if s.get("type") in ("object", ["object"]):
        if not any(k in s for k in ("properties", "patternProperties", "additionalProperties",
                                    "unevaluatedProperties", "propertyNames")):
            s["additionalProperties"] = True
