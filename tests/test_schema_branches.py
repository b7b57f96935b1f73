"""schema_branches: oneOf as anyOf where branches exclude one another, narrowed until they do, or refused."""

from __future__ import annotations

import jsonschema
import pytest

from plait.runtime.constrained.schema_branches import one_of, siblings_into_branches
from plait.runtime.constrained.schema_context import SchemaRewrite


def test_disjoint_branches_become_an_anyof_exactly():
    s = {"oneOf": [{"type": "string"}, {"type": "integer"}, {"const": None}]}
    ctx = SchemaRewrite(s, "xgrammar")
    one_of(ctx, s, "#")
    assert s == {"anyOf": [{"type": "string"}, {"type": "integer"}, {"const": None}]}
    assert not ctx.narrowed and not ctx.problems


def test_exactly_one_of_no_branches_admits_nothing():
    from plait.runtime.constrained import GrammarError
    from plait.runtime.constrained.schema_policy import prepare_schema

    s = {"type": "string", "oneOf": []}
    one_of(SchemaRewrite(s, "xgrammar"), s, "#")
    assert s == {"enum": []}
    with pytest.raises(GrammarError, match="no value satisfies"):
        prepare_schema({"oneOf": []}, "xgrammar")


def test_overlapping_branches_are_refused_without_narrowing_and_told_apart_with_it():
    branches = [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]  # {"a", "b"}: both
    s = {"oneOf": [dict(b) for b in branches]}
    ctx = SchemaRewrite(s, "xgrammar", narrow=False)
    one_of(ctx, s, "#")
    assert ctx.problems == ["'oneOf' whose branches may overlap (exactly-one cannot be enforced: branches 0 and 1 "
                            "may both match) at #/oneOf"]
    s = {"oneOf": [dict(b) for b in branches]}
    ctx = SchemaRewrite(s, "xgrammar")
    one_of(ctx, s, "#")
    assert not ctx.problems and ctx.narrowed and len(s["anyOf"]) == 2
    first, second = (jsonschema.Draft202012Validator(b) for b in s["anyOf"])
    assert first.is_valid({"a": 1}) and second.is_valid({"b": 1})
    assert not first.is_valid({"a": 1, "b": 1}) and not second.is_valid({"a": 1, "b": 1})  # exactly one holds


def test_siblings_move_into_the_branches_they_may_meet():
    s = {"type": "string", "maxLength": 5, "anyOf": [{"minLength": 2}, {"type": "integer"}]}
    siblings_into_branches(SchemaRewrite(s, "xgrammar"), s)
    assert s == {"anyOf": [{"allOf": [{"type": "string", "maxLength": 5}, {"minLength": 2}]}]}
