"""The last pass over a subschema, once its children are rewritten: parts that admit no value dropped where
their parent allows it, or the parent left admitting none."""

from __future__ import annotations

from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_keywords import make_impossible
from plait.runtime.constrained.schema_normalize import values_of_type


def prune(ctx: SchemaRewrite, s: dict) -> None:
    """Parts that admit no value (`false`, an empty enum: an `enum` none of whose values has the
    `type`, an `allOf` whose values clash) dropped where their parent allows it: an anyOf branch, an
    optional property, the items past a prefix. A required one leaves the parent admitting none."""
    values_of_type(s)  # again: an allOf merged since may have brought a type or values
    if isinstance(s.get("anyOf"), list) and s["anyOf"]:
        kept = [b for b in s["anyOf"] if not ctx.impossible(b)]
        if not kept:
            return make_impossible(s)
        s["anyOf"] = kept
    props = s.get("properties")
    for name, sub in list(props.items()) if isinstance(props, dict) else []:
        if sub is False or not ctx.impossible(sub):
            continue
        if name in (s.get("required") or []):
            return make_impossible(s)
        if s.get("additionalProperties") is False and not s.get("patternProperties"):
            del props[name]  # unlisted, it is forbidden anyway (and xgrammar refuses `false`)
        else:
            props[name] = False
    if "additionalProperties" in s and s["additionalProperties"] is not False \
            and ctx.impossible(s["additionalProperties"]):
        s["additionalProperties"] = False
    if "items" in s and s["items"] is not False and ctx.impossible(s["items"]):
        s.pop("items")
        s["maxItems"] = min(s.get("maxItems", 1 << 30), len(s.get("prefixItems") or []))
        if s.get("minItems", 0) > s["maxItems"]:
            return make_impossible(s)
