"""schema_merge: allOf merged into its parent keyword by keyword, alone on small schemas."""

from __future__ import annotations

from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_merge import flattened, merge_all_of


def _merged(schema: dict) -> tuple[dict, list[str]]:
    ctx = SchemaRewrite(schema, "xgrammar")
    merge_all_of(ctx, schema, "#")
    return schema, ctx.problems


def test_bounds_tighten_types_intersect_and_required_names_unite():
    s, problems = _merged({"allOf": [{"type": ["integer", "string"], "minimum": 1, "required": ["a"]},
                                     {"type": "integer", "minimum": 5, "maximum": 9, "required": ["b"]}]})
    assert not problems
    assert s["type"] == "integer" and s["minimum"] == 5 and s["maximum"] == 9
    assert sorted(s["required"]) == ["a", "b"]


def test_parts_that_clash_admit_nothing():
    s, problems = _merged({"allOf": [{"type": "string"}, {"type": "integer"}]})
    assert s == {"enum": []} and not problems


def test_additional_properties_apply_to_the_other_parts_names():
    s, _ = _merged({"allOf": [{"properties": {"a": {}}, "additionalProperties": False},
                              {"properties": {"b": {"type": "string"}}}]})
    assert s["properties"]["b"] is False  # a's part forbids every name it does not list


def test_a_reference_part_is_merged_and_a_bad_part_is_named():
    root = {"$defs": {"n": {"type": "number", "maximum": 3}}, "allOf": [{"$ref": "#/$defs/n"}, {"minimum": 1}]}
    s, problems = _merged(root)
    assert s["maximum"] == 3 and s["minimum"] == 1 and not problems
    _, problems = _merged({"allOf": [False]})
    assert problems == ["'allOf' with a false part at #/allOf/0"]


def test_flattened_merges_on_the_side():
    root = {"oneOf": []}
    ctx = SchemaRewrite(root, "xgrammar")
    branch = {"allOf": [{"type": "string"}, {"maxLength": 3}]}
    assert flattened(ctx, branch, {"minLength": 1}, None) == {"minLength": 1, "type": "string", "maxLength": 3}
    assert branch == {"allOf": [{"type": "string"}, {"maxLength": 3}]}  # the branch itself is left as it was
    assert not ctx.problems and not ctx.narrowed
