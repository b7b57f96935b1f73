"""schema_facts: what subschemas admit, asked without rewriting them."""

from __future__ import annotations

from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_facts import admits, pair_disjoint, pinned, types


def test_types_and_pinned_values():
    root = {"$defs": {"e": {"enum": ["x", 1]}}}
    ctx = SchemaRewrite(root, "xgrammar")
    assert types(ctx, {"$ref": "#/$defs/e"}) == {"string", "integer"}
    assert types(ctx, {"anyOf": [{"type": "null"}, {"type": "boolean"}]}) == {"null", "boolean"}
    assert pinned(ctx, {"allOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}) == {'"b"'}
    assert pinned(ctx, {"type": "string"}) is None


def test_pair_disjoint():
    ctx = SchemaRewrite({}, "xgrammar")
    assert pair_disjoint(ctx, {"type": "string"}, {"type": "integer"})
    assert not pair_disjoint(ctx, {"type": "number"}, {"type": "integer"})  # 1 is both
    assert pair_disjoint(ctx, {"const": "a"}, {"enum": ["b", "c"]})
    assert pair_disjoint(ctx, {"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 4})
    a = {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "x"}}}
    b = {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "y"}}}
    assert pair_disjoint(ctx, a, b)
    assert not pair_disjoint(ctx, a, {"type": "object"})


def test_admits_asks_jsonschema():
    ctx = SchemaRewrite({"$defs": {"n": {"type": "integer"}}}, "xgrammar")
    assert admits(ctx, {"$ref": "#/$defs/n"}, 3) and not admits(ctx, {"$ref": "#/$defs/n"}, "3")
