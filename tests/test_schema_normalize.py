"""schema_normalize: rewrites of one subschema that keep its meaning, each run alone on a small schema."""

from __future__ import annotations

from plait.runtime.constrained.schema_context import SchemaRewrite
from plait.runtime.constrained.schema_normalize import finish_object, infer_type, normalize, values_of_type


def _normalized(schema: dict, backend: str = "llguidance") -> dict:
    normalize(SchemaRewrite(schema, backend), schema, "#")
    return schema


def test_older_drafts_forms_become_2020_12s():
    assert _normalized({"type": "number", "minimum": 3, "exclusiveMinimum": True}) == \
        {"type": "number", "exclusiveMinimum": 3}
    assert _normalized({"type": "number", "maximum": 3, "exclusiveMaximum": False}) == {"type": "number", "maximum": 3}
    assert _normalized({"type": "array", "items": [{"type": "string"}], "additionalItems": False}) == \
        {"type": "array", "prefixItems": [{"type": "string"}], "items": False}
    assert _normalized({"type": "string", "maxLength": 4.0})["maxLength"] == 4  # a count, as an integer
    assert isinstance(_normalized({"type": "string", "maxLength": 4.0})["maxLength"], int)


def test_type_keywords_imply_their_type():
    one = {"minLength": 2}
    infer_type(SchemaRewrite(one, "xgrammar"), one, "#")
    assert one == {"minLength": 2, "type": "string"}  # narrower: a number would have been valid too
    several = {"minLength": 2, "minimum": 1}
    infer_type(SchemaRewrite(several, "xgrammar"), several, "#")
    branches = several["anyOf"]  # exact: each family binds its own type, the other types stay open
    assert {"type": "string", "minLength": 2} in branches and {"type": "number", "minimum": 1} in branches
    assert {"type": ["array", "boolean", "null", "object"]} in branches


def test_values_keep_only_their_type_and_a_const_meets_its_enum():
    s = {"type": "integer", "enum": [1, "1", 2.0, 2.5, None]}
    values_of_type(s)
    assert s["enum"] == [1, 2.0]
    s = {"enum": ["a", "b"], "const": "b"}
    values_of_type(s)
    assert s == {"enum": ["b"]}
    s = {"type": "string", "const": 3}
    values_of_type(s)
    assert s["enum"] == []  # no value left


def test_a_number_format_becomes_its_range_and_an_unknown_format_an_annotation():
    s = _normalized({"type": "integer", "format": "int32", "minimum": -5})
    assert "format" not in s and s["minimum"] == -5 and s["maximum"] == 2**31 - 1
    assert _normalized({"type": "string", "format": "binary"}) == {"type": "string"}


def test_finished_objects_list_required_names_and_an_empty_object_stays_open():
    s = {"type": "object", "required": ["a"], "additionalProperties": {"type": "integer"}}
    finish_object(SchemaRewrite(s, "xgrammar"), s, "#")
    assert s["properties"] == {"a": {"type": "integer"}}  # what JSON Schema gives an unlisted name
    s = {"type": "object"}
    finish_object(SchemaRewrite(s, "xgrammar"), s, "#")
    assert s == {"type": "object", "additionalProperties": True}
    bad = {"type": "object", "required": ["a"], "additionalProperties": False}
    ctx = SchemaRewrite(bad, "xgrammar")
    finish_object(ctx, bad, "#")
    assert ctx.problems == ["required name 'a' that additionalProperties forbids at #/required"]
