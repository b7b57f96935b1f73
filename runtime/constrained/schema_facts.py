"""What a subschema admits, asked without rewriting it: its JSON types, the values it pins, whether two
subschemas share an instance (what tells oneOf branches apart), whether jsonschema finds a value valid.

Disjointness is judged between a branch as it will be enforced (rewritten, maybe narrowed: root None) and the
others as sent (root `ctx.original`): a narrowed branch must still exclude the others' every instance, not only
their narrowed ones."""

from __future__ import annotations

import json
from typing import Any

from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_keywords import JSON_TYPES, pinned_values, type_of


def types(ctx: SchemaRewrite, s: Any, root: Any = None) -> set[str]:
    s = ctx.deref(s, root)
    if not isinstance(s, dict):
        return set(JSON_TYPES) if s is not False else set()
    if "const" in s:
        return {type_of(s["const"])}
    if isinstance(s.get("enum"), list):
        return {type_of(v) for v in s["enum"]}
    t = s.get("type")
    if isinstance(t, str):
        out = {t}
    elif isinstance(t, list):
        out = set(t)
    elif "anyOf" in s or "oneOf" in s:
        out = set().union(*(types(ctx, b, root) for b in (s.get("anyOf") or s.get("oneOf") or [])))
    else:
        out = set(JSON_TYPES)
    if "integer" in out or "number" in out:  # 1 is both an integer and a number
        out |= {"integer", "number"}
    return out

def pair_disjoint(ctx: SchemaRewrite, a: Any, b: Any, depth: int = 0, ra: Any = None, rb: Any = None) -> bool:
    """No instance is valid for both (a resolved in `ra`, b in `rb`: None the rewritten schema)."""
    # merging and disjointness need each other: an allOf is judged as one merged schema, and merging two
    # anyOfs keeps the pairs of branches this finds not disjoint
    from plait.runtime.constrained.schema_merge import flattened

    a, b = flattened(ctx, a, {}, ra), flattened(ctx, b, {}, rb)  # an allOf as one schema, where it merges
    a, b = ctx.deref(a, ra), ctx.deref(b, rb)
    if a is False or b is False:
        return True
    if not types(ctx, a, ra) & types(ctx, b, rb):
        return True
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    pins = pinned(ctx, a), pinned(ctx, b)
    if None not in pins and not (_values(pins[0]) & _values(pins[1])):
        return True  # both pin values, none in common (a discriminator's consts: no validator needed)
    for x, y in ((a, b), (b, a)):  # the values one pins, each checked against the other
        values = pinned(ctx, x)
        if values is not None and not any(admits(ctx, y, json.loads(v)) for v in values):
            return True
    if depth >= 4:  # recursive schemas: stop looking
        return False
    for x, rx, y, ry in ((a, ra, b, rb), (b, rb, a, ra)):  # every instance of x is in one of its branches
        branches = x.get("anyOf") or x.get("oneOf")
        if isinstance(branches, list) and branches and len(branches) <= 64 and all(
                pair_disjoint(ctx, branch, y, depth + 1, rx, ry) for branch in branches):
            return True
    # the rules below look at objects' properties (arrays' items): they hold where that is all both admit
    common = types(ctx, a, ra) & types(ctx, b, rb)
    for x, y in ((a, b), (b, a)):  # x's instances have more properties (items) than y's may
        needs = max(len(set(x.get("required") or [])), _count(x, "minProperties"))
        if (common <= {"object"} and needs > _count(y, "maxProperties", needs)) or (
                common <= {"array"} and _count(x, "minItems") > _count(y, "maxItems", 1 << 62)) or (
                common <= {"string"} and _count(x, "minLength") > _count(y, "maxLength", 1 << 62)):
            return True
        if common <= {"integer", "number"} and _above(x, y):
            return True
    for x, rx, y, ry in ((a, ra, b, rb), (b, rb, a, ra)):
        for key in (x.get("required") or []) if common <= {"object"} else []:
            xp, yp = (x.get("properties") or {}).get(key), (y.get("properties") or {}).get(key)
            if yp is None and not y.get("patternProperties") and isinstance(y.get("additionalProperties"), dict):
                yp = y["additionalProperties"]  # what y allows of a name it does not list
            # x has the name, and where y's instance has it, y gives it values x's cannot take
            if xp is not None and yp is not None and pair_disjoint(ctx, xp, yp, depth + 1, rx, ry):
                return True
            if (y.get("additionalProperties") is False and key not in (y.get("properties") or {})
                    and not y.get("patternProperties")) or (y.get("properties") or {}).get(key) is False:
                return True
    if types(ctx, a, ra) == types(ctx, b, rb) == {"array"} \
            and min(a.get("minItems", 0), b.get("minItems", 0)) >= 1 \
            and isinstance(a.get("items"), dict) and isinstance(b.get("items"), dict) \
            and not a.get("prefixItems") and not b.get("prefixItems"):
        return pair_disjoint(ctx, a["items"], b["items"], depth + 1, ra, rb)  # their first items differ
    return False

def admits(ctx: SchemaRewrite, sub: Any, value: Any) -> bool:
    """Whether jsonschema finds `value` valid for `sub` (references resolved in the schema as sent:
    the walk rewrites the one it is given). True when it cannot tell. One validator serves the walk (its
    registry of the definitions is most of a validator's cost), and the answers for the schema as sent,
    which the walk never changes, are remembered."""
    key = (id(sub), json.dumps(value, sort_keys=True)) if id(sub) in sent_ids(ctx) else None
    if key is not None and key in ctx.admitted:
        return ctx.admitted[key]
    try:
        ok = next(validator(ctx).descend(value, sub), None) is None
    except Exception:  # noqa: BLE001 - an unresolvable reference, a bad pattern: assume it admits
        ok = True
    if key is not None:
        ctx.admitted[key] = ok
    return ok

def validator(ctx: SchemaRewrite):
    if ctx.checker is None:
        import jsonschema

        root = ctx.original if isinstance(ctx.original, dict) else {}
        probe = {k: v for k, v in root.items() if k in ("definitions", "$defs")}
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        ctx.checker = cls(probe, format_checker=cls.FORMAT_CHECKER)
    return ctx.checker

def sent_ids(ctx: SchemaRewrite) -> set[int]:
    """The ids of the schema as sent's every node (it outlives the walk, so they stay unique)."""
    if ctx.original_ids is None:
        ctx.original_ids, stack = set(), [ctx.original]
        while stack:
            node = stack.pop()
            if isinstance(node, (dict, list)):
                ctx.original_ids.add(id(node))
                stack.extend(node.values() if isinstance(node, dict) else node)
    return ctx.original_ids

def sent_one_ofs(ctx: SchemaRewrite) -> dict[str, list]:
    """Every oneOf of the schema as sent, by its text."""
    if ctx.one_ofs is None:
        ctx.one_ofs, stack = {}, [ctx.original]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("oneOf"), list):
                    ctx.one_ofs.setdefault(json.dumps(node["oneOf"], sort_keys=True), node["oneOf"])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return ctx.one_ofs

def pinned(ctx: SchemaRewrite, sub: Any) -> set[str] | None:
    """The values a subschema allows (as JSON text), where it pins them (const, enum, or an allOf
    with such parts)."""
    sub = ctx.deref(sub)
    if isinstance(sub, dict) and isinstance(sub.get("allOf"), list):
        sets = [v for v in (pinned(ctx, p) for p in sub["allOf"]) if v is not None]
        return set.intersection(*sets) if sets else None
    return pinned_values(sub)


def _values(pinned: set[str]) -> set[str]:
    """Pinned values (JSON texts) as JSON compares them: 1.0 is 1."""
    out = set()
    for text in pinned:
        v = json.loads(text)
        out.add(json.dumps(int(v)) if isinstance(v, float) and v.is_integer() else text)
    return out


def _above(x: dict, y: dict) -> bool:
    """Whether by their bounds every number x admits lies above every number y admits (a draft-4 boolean
    `exclusiveMinimum` is left out: its bound then reads as inclusive, a wider range)."""
    def bounds(s: dict, keys: tuple[str, str]) -> list[tuple[float, bool]]:
        return [(s[k], k == keys[1]) for k in keys if isinstance(s.get(k), (int, float)) and not isinstance(s[k], bool)]

    return any(low > high or (low == high and (open_low or open_high))
               for low, open_low in bounds(x, ("minimum", "exclusiveMinimum"))
               for high, open_high in bounds(y, ("maximum", "exclusiveMaximum")))


def _count(s: dict, key: str, default: int = 0) -> int:
    """A count keyword's value (minProperties, maxItems), or `default` where it is absent or not a count."""
    v = s.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default
