"""Narrowings: where no backend enforces a keyword, a stricter schema whose every instance is valid for the one
sent (uniqueItems, dependencies, an undecided if, not, propertyNames, contains, counts). Each is noted."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from plait.runtime.constrained import schema_facts as facts
from plait.runtime.constrained.formats import NARROWER
from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_keywords import ANNOTATIONS, conjunction, is_number, lookup, required_names


def narrow_keywords(ctx: SchemaRewrite, s: dict, ptr: str | None) -> None:
    """Rewrites whose every instance is valid for the original (not every valid instance is one):
    - `uniqueItems` with minItems <= 1: at most one item;
    - `dependencies`/`dependentRequired`/`dependentSchemas` on a property: with names, the property
      required with them; with a schema, merged through allOf where the property is required,
      else the property absent;
    - `not` of required names: those properties absent; `not` of types: the other types."""
    if s.get("uniqueItems") is True and s.get("minItems", 0) <= 1:
        s.pop("uniqueItems")
        s["maxItems"] = 1
        ctx.note(ptr, "uniqueItems as at most one item")
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        deps = s.get(key)
        if not isinstance(deps, dict):
            continue
        s.pop(key)
        required = s.setdefault("required", [])
        for name, dep in deps.items():
            if isinstance(dep, list):  # names: required with it
                if name not in required:
                    ctx.note(ptr, f"{key} of {name!r} as {name!r} required")
                required.extend([name, *dep])
            elif name in required or dep is True:
                s.setdefault("allOf", []).append(dep)
            else:  # a schema (often a `not` of other names, which requiring could contradict): absent
                s.setdefault("properties", {})[name] = False
                ctx.note(ptr, f"{key} of {name!r} as {name!r} absent")
        s["required"] = list(dict.fromkeys(required))
    if "contains" in s or "minContains" in s or "maxContains" in s:
        narrow_contains(ctx, s, ptr)
    if isinstance(s.get("not"), dict):
        narrow_not(ctx, s)
        if "not" not in s:
            ctx.note(ptr, "not as what it leaves (names absent, other types or values)")
    if "propertyNames" in s and "propertyNames" not in ctx.supported:
        names_as_properties(ctx, s)
        if "propertyNames" not in s:
            ctx.note(ptr, "propertyNames as the properties it admits")
    if ("minProperties" in s or "maxProperties" in s) and ctx.backend == "llguidance":
        narrow_counts(ctx, s, ptr)

def narrow_contains(ctx: SchemaRewrite, s: dict, ptr: str | None) -> None:
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
        match = conjunction(copy.deepcopy(prefix[i] if i < len(prefix) else items), copy.deepcopy(contains))
        if i < len(prefix):
            prefix[i] = match
        else:
            prefix.append(match)
    if prefix:
        s["prefixItems"] = prefix
    s["minItems"] = max(s.get("minItems", 0), least)
    if most is not None:
        s["maxItems"] = min(s.get("maxItems", most), most)
    ctx.note(ptr, "contains as the first items matching it")

def names_as_properties(ctx: SchemaRewrite, s: dict) -> None:
    """`propertyNames` of an enum, a pattern, lengths or a narrowed format as the properties or
    patternProperties it admits, no others: listed names it refuses become absent, and its own names
    meet additionalProperties (a listed name it admits meets it too: narrower). Beside
    patternProperties, only where the pattern is theirs or theirs matches every name."""
    names = ctx.deref(s["propertyNames"])
    if not isinstance(names, dict):
        return
    keys = set(names) - ANNOTATIONS - {"type"}
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

def narrow_counts(ctx: SchemaRewrite, s: dict, ptr: str | None) -> None:
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
    optional.sort(key=lambda n: recursion_rank(ctx, s["properties"][n], s))
    s["required"] = required + optional[:keep]
    for name in optional[keep:]:
        s["properties"][name] = False
    s["additionalProperties"] = False
    s.pop("minProperties", None)
    s.pop("maxProperties", None)
    ctx.note(ptr, "minProperties/maxProperties as the listed properties, required")

def recursion_rank(ctx: SchemaRewrite, sub: Any, target: dict) -> int:
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
                pending.append(lookup(ctx.root, ref))
            pending.extend(v for k, v in node.items() if k != "$ref")
        elif isinstance(node, list):
            pending.extend(node)
    return rank

def narrow_not(ctx: SchemaRewrite, s: dict) -> None:
    """`not` of required names (alone, in allOf or anyOf): a name of each group absent; of types:
    the other types; of values: numbers above them, strings longer than them, or the values left."""
    neg = ctx.deref(s["not"])
    if not isinstance(neg, dict):
        return
    keys = set(neg) - ANNOTATIONS
    groups = None  # name groups none of which may be all present
    if keys == {"anyOf"} and isinstance(neg["anyOf"], list):
        groups = [required_names(ctx.deref(b)) for b in neg["anyOf"]]
    elif keys == {"allOf"} and isinstance(neg["allOf"], list):
        parts = [required_names(ctx.deref(b)) for b in neg["allOf"]]
        groups = [sum(parts, [])] if all(p is not None for p in parts) else None
    else:
        groups = [required_names(neg)]
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
        allowed = facts.types(ctx, s) - banned - ({"number"} if "integer" in banned else set())
        if allowed:
            s.pop("not")
            s["type"] = sorted(allowed) if len(allowed) > 1 else allowed.pop()
    elif keys in ({"enum"}, {"const"}):
        banned = neg["enum"] if "enum" in keys else [neg["const"]]
        if not isinstance(banned, list):
            return
        kept = facts.pinned(ctx, s)
        if kept is not None:
            s.pop("not")
            values = [v for v in map(json.loads, sorted(kept)) if v not in banned]
            s.pop("const", None)
            s["enum"] = values
        elif facts.types(ctx, s) <= {"integer", "number"} and all(is_number(v) for v in banned):
            top = max(banned)
            if s.get("maximum", top + 1) > top and s.get("exclusiveMaximum", top + 2) > top + 1:
                s.pop("not")
                if s.get("minimum", top) <= top:
                    s["exclusiveMinimum"] = max(top, s.get("exclusiveMinimum", top))
        elif facts.types(ctx, s) == {"string"} and all(isinstance(v, str) for v in banned):
            s.pop("not")
            s["minLength"] = max(s.get("minLength", 0), max(len(v) for v in banned) + 1)

def decided(ctx: SchemaRewrite, cond: Any, s: dict) -> bool | None:
    """Whether `cond` holds for every instance of `s` (True), for none (False), or either (None),
    judged on the properties both pin to values (a discriminator: `{"properties": {"kind":
    {"const": "a"}}}`)."""
    if not isinstance(cond, dict) or set(cond) - ANNOTATIONS - {"properties", "required"}:
        return None
    required = set(s.get("required") or [])
    holds = True
    for name in cond.get("required") or []:
        if name not in required:
            holds = False if (s.get("properties") or {}).get(name) is False else None
    for name, sub in (cond.get("properties") or {}).items():
        want = facts.pinned(ctx, sub)
        have = facts.pinned(ctx, (s.get("properties") or {}).get(name))
        if want is None or have is None:
            return None if holds is not False else False
        if not want & have and name in required:
            return False
        if not have <= want:
            holds = None
    return holds

def if_then_else(ctx: SchemaRewrite, s: dict, ptr: str | None, context: dict | None = None) -> None:
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
    holds = decided(ctx, cond, context)
    split = split_on_values(ctx, cond, then, other, context) if holds is None else None
    if holds is None and (split is None or s.get("anyOf")):
        if not ctx.narrow:
            return  # refused by name
        ctx.note(ptr, "if/then/else as its `if` holding")
        if isinstance(cond, dict):
            pins = [n for n, sub in (cond.get("properties") or {}).items() if facts.pinned(ctx, sub) is not None]
            cond = {**cond, "required": list(dict.fromkeys((cond.get("required") or []) + pins))}
    for key in ("if", "then", "else"):
        s.pop(key, None)
    if holds is None and split is not None and not s.get("anyOf"):
        s["anyOf"] = split
    else:
        s.setdefault("allOf", []).extend([other] if holds is False else [then] if holds else [cond, then])

def split_on_values(ctx: SchemaRewrite, cond: Any, then: Any, other: Any, s: dict) -> list | None:
    """An `if` on one required property that the schema pins to finitely many values, as an anyOf
    of the values it admits (with `then`) and the others (with `else`): exact."""
    if not isinstance(cond, dict) or set(cond) - ANNOTATIONS - {"properties", "required"}:
        return None
    props = cond.get("properties") or {}
    if len(props) != 1:
        return None
    (name, sub), = props.items()
    want, have = facts.pinned(ctx, sub), facts.pinned(ctx, (s.get("properties") or {}).get(name))
    if want is None or have is None or name not in (s.get("required") or []) \
            or not set(cond.get("required") or []) <= {name}:
        return None
    inside, outside = sorted(have & want), sorted(have - want)
    if not inside or not outside:
        return None
    return [{"allOf": [{"properties": {name: {"enum": [json.loads(v) for v in values]}}}, branch]}
            for values, branch in ((inside, then), (outside, other))]
