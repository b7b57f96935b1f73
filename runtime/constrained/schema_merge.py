"""`allOf` merged into its parent keyword by keyword: bounds tighten, types and enums intersect, required
names unite, a property both parts constrain gets both; what cannot merge exactly is refused."""

from __future__ import annotations

import copy
from typing import Any

from plait.runtime.constrained import schema_facts as facts
from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_keywords import (ANNOTATIONS, ASSERTING, CLASH, MAX_BRANCH_PAIRS, conjunction,
                                                       make_impossible, merge_keyword)
from plait.runtime.constrained.schema_narrowing import if_then_else, narrow_keywords
from plait.runtime.constrained.schema_normalize import exact_format, infer_type, own_unevaluated


def merge_all_of(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
    """Merge `allOf` parts into their parent, keyword by keyword, where the conjunction has a form
    the backends take (exact): bounds tighten, types and enums intersect, required names unite, a
    property both constrain gets both (as its own allOf), and `additionalProperties` keeps applying
    to the names its own part did not list."""
    parts = s.pop("allOf")
    if not isinstance(parts, list):
        ctx.bad(f"{ptr}/allOf", "'allOf' that is not a list")
        return
    queue = [(f"{ptr}/allOf/{i}", part) for i, part in enumerate(parts)]
    while queue:
        where, part = queue.pop(0)
        if part is True:
            continue
        if not isinstance(part, dict):
            ctx.bad(where, "'allOf' with a false part")
            continue
        if ctx.unfetched(part.get("$ref"), where):
            return make_impossible(s)
        if "$ref" in part and len([k for k in part if k not in ANNOTATIONS]) == 1:
            target = ctx.resolve(part["$ref"], where)
            if not isinstance(target, dict) or "$ref" in target:
                ctx.bad(where, "'allOf' of a reference that cannot be merged")
                continue
            part, where = target, part["$ref"]
        part = copy.deepcopy(part)
        if not own_unevaluated(ctx, part, where):
            continue
        exact_format(ctx, part, where)
        infer_type(ctx, part, where)
        if_then_else(ctx, part, where, context=s)
        if ctx.narrow:
            narrow_keywords(ctx, part, where)
        # a part's own parts next, before the following parts (a narrowed `if` is merged before the next is judged)
        queue[0:0] = [(f"{where}/allOf/{i}", sub) for i, sub in enumerate(part.pop("allOf", None) or [])]
        if "oneOf" in part:
            ctx.origins[id(s)] = (s, where)  # s kept alive: its id names no other schema
        merge_part(ctx, s, part, where)

def merge_part(ctx: SchemaRewrite, s: dict, part: dict, where: str) -> None:
    for closer, other in ((s, part), (part, s)):  # names one part did not list meet its additionalProperties
        extra = closer.get("additionalProperties", True)
        if extra is True:
            continue
        for name in list(other.get("properties") or {}):
            if name in (closer.get("properties") or {}):
                continue
            if closer.get("patternProperties"):
                ctx.bad(where, "'allOf' whose parts list different properties beside patternProperties")
                return
            closer.setdefault("properties", {})[name] = copy.deepcopy(extra)
    for x, y in ((s, part), (part, s)):  # x's items (without a prefix) apply to y's prefix positions too
        if "prefixItems" in y and "prefixItems" not in x and "items" in x and isinstance(y["prefixItems"], list):
            y["prefixItems"] = [conjunction(p, copy.deepcopy(x["items"])) for p in y["prefixItems"]]
    for key, value in part.items():
        if key not in ASSERTING:
            continue
        if key not in s or s[key] == value:
            s[key] = value
            continue
        if key == "anyOf" and isinstance(value, list) and isinstance(s[key], list):
            # (A1 or A2) and (B1 or B2): every pair, less those no instance satisfies
            merged = [conjunction(x, y) for x in s[key] for y in value if not facts.pair_disjoint(ctx, x, y)]
            merged = merged if 0 < len(merged) <= MAX_BRANCH_PAIRS else CLASH
        else:
            merged = merge_keyword(key, s[key], value)
        if key == "pattern" and ctx.may_add_pattern(s):
            ctx.add_pattern(s, value)
            continue
        if merged is CLASH and key in ("type", "enum", "const"):
            return make_impossible(s)  # no value is of both types or both values: the parts clash
        if merged is CLASH:
            ctx.bad(where, f"'allOf' whose parts both constrain {key!r}")
        else:
            s[key] = merged

def flattened(ctx: SchemaRewrite, branch: Any, siblings: dict, root: Any) -> Any:
    """`branch` and `siblings` as one schema, where the allOf merge is exact (else `branch`); the
    branch's references resolve in `root` (None: the schema being rewritten)."""
    b = ctx.deref(branch, root)
    if not isinstance(b, dict) or not (siblings or isinstance(b.get("allOf"), list)):
        return branch
    trial = ctx.trial(root)
    merged = {**copy.deepcopy(siblings), "allOf": [copy.deepcopy(b)]}
    merge_all_of(trial, merged, "#")
    return branch if trial.problems or "allOf" in merged or trial.impossible(merged) else merged
