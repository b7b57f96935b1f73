"""oneOf branches told apart: a `oneOf` is an `anyOf` where no instance can be valid for two branches
(disjoint types, pinned values, required names one forbids, discriminators), else narrowed until each branch
excludes the others as sent, else refused naming the pair; and what stands beside an anyOf moved into its
branches, for backends that drop it."""

from __future__ import annotations

import copy
import json
from typing import Any

from plait.runtime.constrained import schema_facts as facts
from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_keywords import (ASSERTING, MAX_BRANCH_PAIRS, NOT_MERGED_INTO_BRANCHES,
                                                       conjunction, lookup, make_impossible)
from plait.runtime.constrained.schema_merge import flattened
from plait.runtime.constrained.schema_narrowing import narrow_keywords, narrow_not


def one_of(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
    """`oneOf` as `anyOf` where no instance can be in two branches. With narrowing, the branches
    narrowed to exclude one another (closed, told apart by required names or a discriminator), and
    those that still overlap another dropped: each kept branch excludes every other as sent."""
    branches = s.pop("oneOf")
    if not isinstance(branches, list):
        ctx.bad(f"{ptr}/oneOf", "'oneOf' that is not a list")
        return
    if not branches:  # exactly one of none: no value
        return make_impossible(s)
    if len(branches) == 1 and not s.get("anyOf"):  # exactly one of one
        s["anyOf"] = branches
        return
    sent, root = sent_branches(ctx, s, ptr, branches)
    chosen = None
    # each branch with what stands beside the oneOf merged in (a discriminator the parent requires,
    # its type): an instance of the parent has them, so they tell branches apart too
    siblings = {k: v for k, v in s.items() if k in ASSERTING and k not in NOT_MERGED_INTO_BRANCHES}
    branches = [flattened(ctx, b, siblings, None) for b in branches]
    if sent is not None:
        sent = [flattened(ctx, b, siblings, root) for b in sent]
    if sent is not None:
        candidates = [branches]
        if ctx.narrow:
            candidates += [n for n in (
                [closed_object(ctx, b) for b in branches], exclusive(ctx, branches, s),
                discriminated(ctx, branches), without_pinned(ctx, branches), typed_apart(ctx, branches))
                if n is not None]
        best = []
        for candidate in candidates:
            kept = exclusive_of_others(ctx, candidate, sent, root)
            if len(kept) == len(branches) or (ctx.narrow and len(kept) > len(best)):
                best = kept
            if len(best) == len(branches):
                break
        if best:
            chosen = [b for _, b in best]
            if len(best) < len(branches) or any(b is not branches[i] for i, b in best):
                ctx.narrower = True
                ctx.narrowed.append(f"oneOf at {ptr}: its branches narrowed to exclude one another"
                                     + (f", {len(branches) - len(best)} of {len(branches)} left out"
                                        if len(best) < len(branches) else ""))
    if chosen is None:
        pair = overlapping_pair(ctx, branches, sent, root)
        ctx.bad(f"{ptr}/oneOf", "'oneOf' whose branches may overlap (exactly-one cannot be enforced"
                 + (f": branches {pair[0]} and {pair[1]} may both match" if pair else "") + ")")
    elif s.get("anyOf"):
        # (A1 or A2) and exactly one of (B1, B2), whose branches now exclude one another: every pair (exact),
        # less those no instance satisfies
        pairs = [conjunction(a, b) for a in s["anyOf"] for b in chosen if not facts.pair_disjoint(ctx, a, b)]
        if len(pairs) > MAX_BRANCH_PAIRS:
            ctx.bad(f"{ptr}/oneOf", f"'oneOf' beside 'anyOf' ({len(pairs)} pairs of branches, over {MAX_BRANCH_PAIRS})")
        elif not pairs:
            make_impossible(s)
        else:
            s["anyOf"] = pairs
    else:
        s["anyOf"] = chosen

def overlapping_pair(ctx: SchemaRewrite, branches: list, sent: list | None, root: Any) -> tuple[int, int] | None:
    """The first two branches no check tells apart (for the refusal's message)."""
    others = sent if sent is not None else branches
    return next(((i, j) for i in range(len(branches)) for j in range(i + 1, len(others))
                 if not facts.pair_disjoint(ctx, branches[i], others[j], rb=root)), None)

def without_pinned(ctx: SchemaRewrite, branches: list) -> list | None:
    """Each branch less the values the other branches pin (`{"enum": ["linux"]}` beside `{"type":
    "string"}`), through `not`'s narrowing (longer strings, larger numbers). None where no other
    branch pins values."""
    pins = [facts.pinned(ctx, b) for b in branches]
    if all(p is None for p in pins):
        return None
    out = []
    for i, branch in enumerate(branches):
        banned = sorted(set().union(*(p for j, p in enumerate(pins) if j != i and p is not None)))
        b = ctx.deref(branch)
        if not banned or not isinstance(b, dict) or "not" in b:
            out.append(branch)
            continue
        b = {**copy.deepcopy(b), "not": {"enum": [json.loads(v) for v in banned]}}
        narrow_not(ctx, b)
        out.append(branch if "not" in b else b)
    return out

def typed_apart(ctx: SchemaRewrite, branches: list) -> list | None:
    """Each branch less the JSON types another branch admits (a branch of anything, such as ajv's
    `{"typeof": "function"}`, beside `{"type": "string"}`: exactly one holds only for the types the others
    leave); a branch left no type admits nothing. None where no two branches share a type."""
    types = [facts.types(ctx, b) for b in branches]
    if sum(len(t) for t in types) == len(set().union(*types)):
        return None
    out, numbers = [], {"integer", "number"}
    for i, branch in enumerate(branches):
        # numbers stay: an integer branch beside a number branch is not told apart by type (1.5 is a number only)
        mine = types[i] - (set().union(*(t for j, t in enumerate(types) if j != i)) - numbers)
        b = ctx.deref(branch)
        if mine == types[i] or not isinstance(b, dict):
            out.append(branch)
        elif not mine:
            out.append(False)
        else:
            out.append({**copy.deepcopy(b), "type": sorted(mine - {"integer"} if "number" in mine else mine)})
    return out

def exclusive_of_others(ctx: SchemaRewrite, candidate: list, sent: list, root: Any) -> list[tuple[int, Any]]:
    """(index, branch) of the candidate branches that admit nothing another branch as sent admits."""
    return [(i, b) for i, b in enumerate(candidate) if b is not False
            and all(facts.pair_disjoint(ctx, b, sent[j], rb=root) for j in range(len(sent)) if j != i)]

def sent_branches(ctx: SchemaRewrite, s: dict, ptr: str, branches: list) -> tuple[list | None, Any]:
    """This oneOf's branches as sent, and the schema to resolve them in: the walk rewrites in place,
    and a definition it has narrowed elsewhere no longer says what the sender's branch admits.
    (None, None) where they cannot be found as sent."""
    merged_from = ctx.origins.get(id(s), (None, None))[1]
    for where in (ptr, merged_from):  # here, or the allOf part it was merged from
        node = lookup(ctx.original, where) if where else None
        found = node.get("oneOf") if isinstance(node, dict) else None
        if isinstance(found, list) and len(found) == len(branches):
            return found, ctx.original
    if not ctx.narrower:
        return branches, None  # nothing narrowed yet: as sent
    # a copy (a parent oneOf's branch with its siblings merged in): the same branches, written the same way,
    # as the sender wrote them somewhere (so they mean there what they meant as sent)
    same = facts.sent_one_ofs(ctx).get(json.dumps(branches, sort_keys=True))
    return (same, ctx.original) if same is not None else (None, None)

def discriminated(ctx: SchemaRewrite, branches: list) -> list | None:
    """Object branches that pin one property to values no other branch allows (or give it schemas no
    value of which two share), each narrowed to require it (absent, it would leave every branch open).
    None where no property does."""
    resolved = [ctx.deref(b) for b in branches]
    if not all(isinstance(b, dict) and "object" in facts.types(ctx, b) for b in resolved):
        return None
    for name in (resolved[0].get("properties") or {}):
        subs = [(b.get("properties") or {}).get(name) for b in resolved]
        pins = [facts.pinned(ctx, sub) for sub in subs]
        if any(p is None for p in pins) or sum(len(p) for p in pins) != len(set().union(*pins)):
            # a property whose schemas admit no common value (`{"kind": {"enum": [...]}}` one level down)
            pairs = [(i, j) for i in range(len(subs)) for j in range(i + 1, len(subs))]
            if len(subs) > 8 or any(sub is None for sub in subs) or not all(
                    facts.pair_disjoint(ctx, subs[i], subs[j], 1) for i, j in pairs):
                continue
        out = []
        for b in resolved:
            b = copy.deepcopy(b)
            b["type"] = "object"
            b["required"] = list(dict.fromkeys((b.get("required") or []) + [name]))
            out.append(b)
        return out
    return None

def exclusive(ctx: SchemaRewrite, branches: list, parent: dict) -> list | None:
    """Object branches narrowed to exclude one another: each forbids the names the others require
    and it does not (so the one an instance matches is decided by which names it has). None where
    two branches require the same names, or a forbidden name is one the parent requires."""
    resolved = [ctx.deref(b) for b in branches]
    if not all(isinstance(b, dict) and "object" in facts.types(ctx, b) for b in resolved):
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

def closed_object(ctx: SchemaRewrite, branch: Any) -> Any:
    """An object branch of a oneOf narrowed so that branches become disjoint: no other properties
    than it names, at least one of them present, its own narrowings applied (`not` of a name)."""
    b = ctx.deref(branch)
    if not isinstance(b, dict) or facts.types(ctx, b) != {"object"} or any(
            k in b for k in ("patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")):
        return branch
    b = copy.deepcopy(b)
    b["type"] = "object"
    narrow_keywords(ctx, b, None)
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


def siblings_into_branches(ctx: SchemaRewrite, s: dict) -> None:
    """A + anyOf [B1, B2] as anyOf [A + B1, A + B2] (exact), for backends that drop what stands
    beside an anyOf (measured: xgrammar takes the branches alone, so a parent's bounds, properties
    and required names were lost)."""
    siblings = {k: s.pop(k) for k in list(s) if k in ASSERTING and k != "anyOf"}
    if siblings:  # less the branches no instance of the siblings can satisfy
        branches = [b for b in s["anyOf"] if not facts.pair_disjoint(ctx, siblings, b)] or s["anyOf"]
        s["anyOf"] = [{"allOf": [copy.deepcopy(siblings), branch]} for branch in branches]
