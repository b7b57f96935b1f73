"""schema_prune: parts that admit no value dropped where their parent allows it."""

from __future__ import annotations

from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_prune import prune


def _pruned(schema: dict) -> dict:
    prune(SchemaRewrite(schema, "llguidance"), schema)
    return schema


def test_impossible_branches_and_optional_properties_go_required_ones_sink_the_parent():
    assert _pruned({"anyOf": [{"enum": []}, {"type": "string"}, False]}) == {"anyOf": [{"type": "string"}]}
    # a child is pruned after its own walk: an enum none of whose values has its type is empty by then
    assert _pruned({"properties": {"a": {"type": "integer", "enum": []}, "b": {}}}) == \
        {"properties": {"a": False, "b": {}}}
    assert _pruned({"properties": {"a": {"enum": []}}, "required": ["a"]}) == {"enum": []}
    assert _pruned({"anyOf": [False]}) == {"enum": []}


def test_impossible_items_past_a_prefix_cap_the_length():
    assert _pruned({"prefixItems": [{}, {}], "items": {"enum": []}}) == {"prefixItems": [{}, {}], "maxItems": 2}
    assert _pruned({"prefixItems": [{}], "items": False, "minItems": 3}) == {"prefixItems": [{}], "items": False,
                                                                              "minItems": 3}
