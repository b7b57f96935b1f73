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

llguidance refuses what it does not implement by itself; the rewrite still lists its keywords, so a
keyword it would accept but not enforce is refused here, and the message names keywords the same
way for every backend.

The rewrite is a walk over the subschemas reachable from the root (`visit`); at each, the passes of
`rewrite_node` run in order over one context (schema_context.SchemaRewrite), each in a module of its own:
normalize (schema_normalize), if/then/else and the narrowings (schema_narrowing), allOf merged
(schema_merge), oneOf's exclusivity (schema_branches), objects finished; then what the backend cannot
enforce is refused, the children are rewritten, and parts admitting nothing are pruned (schema_prune).
"""

from __future__ import annotations

import json
from typing import Any

from plait.runtime.constrained.base import GrammarError
from plait.runtime.constrained.closed_objects import close_objects
from plait.runtime.constrained.schema_branches import one_of, siblings_into_branches
from plait.runtime.constrained.schema_context import SchemaRewrite, json_copy
from plait.runtime.constrained.schema_keywords import (ASSERTING, FORMATS, LENGTHS_WITH_PATTERN, SIBLINGS_WITH_ANYOF,
                                                       TRUSTED_PATTERNS, UNTRUSTED_PATTERNS, is_noop, lookup,
                                                       make_impossible)
from plait.runtime.constrained.schema_merge import merge_all_of
from plait.runtime.constrained.schema_narrowing import if_then_else, narrow_keywords
from plait.runtime.constrained.schema_normalize import (exact_format, finish_object, normalize, unevaluated_items,
                                                        unevaluated_properties)
from plait.runtime.constrained.schema_prune import prune
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
    ctx = SchemaRewrite(schema, backend, narrow)
    visit(ctx, schema, "#")
    if ctx.impossible(schema):
        ctx.problems.insert(0, f"a schema that needs what {ctx.remote[0]!r} names (another document: plait "
                            "fetches none) at #" if ctx.remote else
                            "a schema that no value satisfies (its types, values or required parts clash) at #")
    if ctx.problems:
        shown = "; ".join(ctx.problems[:8]) + (f"; and {len(ctx.problems) - 8} more" if len(ctx.problems) > 8 else "")
        raise GrammarError(f"json_schema uses what the {backend} backend cannot enforce: {shown}")
    close_objects(schema, lambda ref: lookup(schema, ref))
    if isinstance(schema, dict):
        # the rewrite speaks draft 2020-12 (tuple `items` became `prefixItems`): a backend told the sender's
        # older draft would read `prefixItems` as an unknown word and let any item through
        schema.pop("$schema", None)
    drop_ids(schema)
    return schema, tuple(dict.fromkeys(ctx.narrowed))


def visit(ctx: SchemaRewrite, s: Any, ptr: str) -> None:
    """Rewrite `s` and every subschema below it, each once."""
    if isinstance(s, bool):
        return
    if not isinstance(s, dict):
        ctx.bad(ptr, "a subschema that is not an object or boolean")
        return
    if id(s) in ctx.seen:
        return
    ctx.seen[id(s)] = s
    rewrite_node(ctx, s, ptr)
    refuse_unenforced(ctx, s, ptr)
    if "$ref" in s:
        target = ctx.resolve(s["$ref"], f"{ptr}/$ref") if isinstance(s["$ref"], str) else None
        if target is not None:
            visit(ctx, target, s["$ref"])
    for key in ("properties", "patternProperties"):
        for name, sub in (s.get(key) or {}).items():
            visit(ctx, sub, f"{ptr}/{key}/{name}")
    for key in ("additionalProperties", "items", "propertyNames", "unevaluatedProperties"):
        if key in s:
            visit(ctx, s[key], f"{ptr}/{key}")
    for key in ("anyOf", "prefixItems"):
        for i, sub in enumerate(s.get(key) or []):
            visit(ctx, sub, f"{ptr}/{key}/{i}")
    prune(ctx, s)


def rewrite_node(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
    """The passes over one subschema, in order: each may bring what a later one handles (an `if` decided into
    an allOf, an allOf part's oneOf, a oneOf's branches into an anyOf)."""
    if ctx.unfetched(s.get("$ref"), ptr):
        return make_impossible(s)
    normalize(ctx, s, ptr)
    if_then_else(ctx, s, ptr)
    if "allOf" in s:
        merge_all_of(ctx, s, ptr)
    if "unevaluatedProperties" in s and "oneOf" not in s:  # before propertyNames sets additionalProperties
        unevaluated_properties(ctx, s, ptr)
    if ctx.narrow:
        narrow_keywords(ctx, s, ptr)
        if "allOf" in s:  # brought by a narrowing (then, dependentSchemas)
            merge_all_of(ctx, s, ptr)
    if "oneOf" in s:
        one_of(ctx, s, ptr)
    if "unevaluatedProperties" in s:  # a oneOf is an anyOf by now
        unevaluated_properties(ctx, s, ptr)
    if "unevaluatedItems" in s:
        unevaluated_items(s)
    if s.get("anyOf") and ctx.backend not in SIBLINGS_WITH_ANYOF:
        siblings_into_branches(ctx, s)
    finish_object(ctx, s, ptr)


def refuse_unenforced(ctx: SchemaRewrite, s: dict, ptr: str) -> None:
    """Each keyword left that the backend would not enforce, refused by name."""
    for key in list(s):
        if key in ASSERTING and key not in ctx.supported and not is_noop(key, s[key]):
            ctx.bad(f"{ptr}/{key}", f"keyword {key!r}")
    if (ctx.backend not in LENGTHS_WITH_PATTERN and ("pattern" in s or "format" in s)
            and ("minLength" in s or "maxLength" in s)):
        ctx.bad(ptr, f"minLength/maxLength beside pattern or format (the {ctx.backend} backend drops one)")
    exact_format(ctx, s, ptr)  # again: an allOf merged since may have brought a format
    fmt = s.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS[ctx.backend]:
        ctx.bad(f"{ptr}/format", f"format {fmt!r}")
    if ctx.backend in UNTRUSTED_PATTERNS and "pattern" in s and s["pattern"] not in TRUSTED_PATTERNS:
        ctx.bad(f"{ptr}/pattern", f"pattern (the {ctx.backend} backend's regex is not exact for every pattern)")
