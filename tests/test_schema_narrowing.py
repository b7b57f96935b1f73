"""schema_narrowing: keywords no backend enforces as stricter schemas whose every instance is valid, each noted;
and if/then/else decided or split exactly."""

from __future__ import annotations

import jsonschema

from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_narrowing import if_then_else, narrow_keywords


def _narrowed(schema: dict) -> tuple[dict, list[str]]:
    ctx = SchemaRewrite(schema, "xgrammar")
    sent = jsonschema.Draft202012Validator(ctx.original)
    narrow_keywords(ctx, schema, "#")
    return schema, ctx.narrowed, sent


def test_unique_items_dependencies_and_not_as_what_they_leave():
    s, notes, _ = _narrowed({"type": "array", "uniqueItems": True})
    assert s == {"type": "array", "maxItems": 1} and notes == ["uniqueItems as at most one item at #"]
    s, notes, _ = _narrowed({"type": "object", "dependentRequired": {"card": ["cvv"]}})
    assert s["required"] == ["card", "cvv"] and notes
    s, notes, _ = _narrowed({"not": {"type": "string"}})
    assert s["type"] == ["array", "boolean", "integer", "null", "number", "object"] and "not" not in s


def test_every_instance_of_a_narrowing_is_valid_as_sent():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["b"]},
              "dependentRequired": {"a": ["c"]}}
    s, notes, sent = _narrowed(schema)
    narrow = jsonschema.Draft202012Validator(s)
    for doc in ({"a": 1, "c": 2}, {"a": 1, "b": 2, "c": 3}, {"a": 1}, {"d": 1}, {}):
        if narrow.is_valid(doc):
            assert sent.is_valid(doc), doc
    assert len(notes) == 2


def test_if_then_else_decided_by_what_the_schema_pins_or_split_on_its_values():
    kind = {"properties": {"kind": {"const": "a"}}}
    s = {"properties": {"kind": {"const": "a"}}, "required": ["kind"], "if": kind, "then": {"required": ["x"]},
         "else": {"required": ["y"]}}
    if_then_else(SchemaRewrite(s, "xgrammar"), s, "#")
    assert s["allOf"] == [{"required": ["x"]}] and "if" not in s  # the if holds: then applies
    s = {"properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"], "if": kind,
         "then": {"required": ["x"]}, "else": {"required": ["y"]}}
    ctx = SchemaRewrite(s, "xgrammar")
    if_then_else(ctx, s, "#")
    assert len(s["anyOf"]) == 2 and not ctx.narrowed  # exact: one branch per side of the condition
