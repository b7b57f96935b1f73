"""What real APIs publish, taken as validators take it (no model): formats a validator does not know as annotations
(OpenAPI's number formats as their ranges), references by any name a validator resolves, and `oneOf` beside
`anyOf` or `allOf` intersected exactly. Each compiled grammar admits a valid document and refuses an invalid one."""

from __future__ import annotations

import json

import jsonschema
import pytest

from schema_corpus import accepts, compact

BACKENDS = ("llguidance", "xgrammar", "outlines")
# jsonschema's format checks, and OpenAPI's number formats as the ranges of their machine types
_CHECKER = jsonschema.FormatChecker()
for _fmt, _bits, _signed in (("int32", 32, True), ("int64", 64, True), ("uint8", 8, False)):
    _low, _high = (-(2 ** (_bits - 1)), 2 ** (_bits - 1) - 1) if _signed else (0, 2 ** _bits - 1)
    _CHECKER.checks(_fmt)(lambda v, low=_low, high=_high: not isinstance(v, int) or low <= v <= high)


def _check(backends, tokenizer, schema: dict, valid: list, invalid: list, names=BACKENDS) -> None:
    """Every backend in `names` compiles `schema`; its grammar admits each of `valid` and none of `invalid` (as
    jsonschema judges them: the cases are checked too)."""
    check = jsonschema.Draft202012Validator(schema, format_checker=_CHECKER)
    for doc in valid:
        assert check.is_valid(doc), doc
    for doc in invalid:
        assert not check.is_valid(doc), doc
    for name in names:
        g = backends[name].compile("json_schema", json.dumps(schema))
        sep = (",", ":") if name == "outlines" else (", ", ": ")  # outlines-core writes no spaces
        for doc in valid:
            assert accepts(g, tokenizer, compact(doc, sep)), (name, doc)
        for doc in invalid:
            assert not accepts(g, tokenizer, compact(doc, sep)), (name, doc)


def test_unknown_formats_are_annotations_and_openapi_number_formats_their_ranges(backends, tokenizer):
    from plait.runtime.constrained import GrammarError
    from plait.runtime.constrained.schema_policy import rewrite_schema

    schema = {"type": "object", "required": ["id", "count", "name", "blob"], "properties": {
        "id": {"type": "integer", "format": "int64"}, "count": {"type": "integer", "format": "int32"},
        "ratio": {"type": "number", "format": "double"}, "name": {"type": "string", "format": "slug-ish"},
        "blob": {"type": "string", "format": "binary"}, "small": {"allOf": [{"type": "integer"}, {"format": "uint8"}]},
        "email": {"type": "string", "format": "email"}}}
    _check(backends, tokenizer, schema, [{"id": 5, "count": -2147483648, "name": "a b", "blob": "x"},
                                         {"id": 1, "count": 2147483647, "name": "", "blob": "", "small": 255}],
           [{"id": 5, "count": 2147483648, "name": "a", "blob": "x"},  # past int32
            {"id": 5, "count": 1, "name": "a", "blob": "x", "small": 256},  # past uint8, its format in an allOf
            {"id": 5, "count": 1, "name": "a", "blob": "x", "email": "nobody"}],  # the formats enforced stay so
           names=("llguidance", "xgrammar"))  # outlines-core enforces no bounds (it refuses them)
    _, notes = rewrite_schema(schema, "llguidance")
    assert "format 'slug-ish' ignored (an annotation: no validator asserts it) at #/properties/name" in notes
    assert not any("binary" in n for n in notes)  # OpenAPI's annotations pass without a note
    assert any(n.startswith("maximum 9223372036854775807 as") for n in notes)  # int64 past llguidance's reach: said
    # 2020-12's format-assertion vocabulary asked for: an unknown format is refused
    asserting = {"$vocabulary": {"https://json-schema.org/draft/2020-12/vocab/format-assertion": True},
                 "type": "string", "format": "slug-ish"}
    with pytest.raises(GrammarError, match="format 'slug-ish'"):
        rewrite_schema(asserting, "llguidance")


def test_references_by_any_name_a_validator_resolves(backends, tokenizer):
    odd = ["LogicalNot<Predicate>", "ConditionalValueDef<(number|ExprRef)>", "a b", "x/y", "t~ilde", "ünï"]
    for name in odd:
        pointer = name.replace("~", "~0").replace("/", "~1")
        encoded = "".join(c if c.isascii() and (c.isalnum() or c in "~_-") else
                          "".join(f"%{b:02X}" for b in c.encode()) for c in pointer)
        schema = {"definitions": {name: {"type": "string", "maxLength": 3}, "Alias": {"$ref": "#/definitions/" + encoded}},
                  "type": "object", "required": ["a", "b"], "properties": {
                      "a": {"$ref": "#/definitions/" + pointer}, "b": {"$ref": "#/definitions/Alias"}}}
        _check(backends, tokenizer, schema, [{"a": "abc", "b": ""}], [{"a": "abcd", "b": ""}, {"a": 1, "b": ""}])
    # $defs nested in $defs, a recursive definition named oddly, a reference through a property's odd name
    schema = {"$defs": {"outer": {"$defs": {"in ner": {"type": "integer", "maximum": 9}}},
                        "T<x>": {"type": "object", "required": ["v"], "properties": {
                            "v": {"type": "integer"}, "next": {"$ref": "#/$defs/T%3Cx%3E"}}}},
              "type": "object", "required": ["n", "c", "t"], "properties": {
                  "n": {"$ref": "#/$defs/outer/$defs/in ner"}, "p q": {"type": "boolean"},
                  "c": {"$ref": "#/properties/p q"}, "t": {"$ref": "#/$defs/T<x>"}}}
    _check(backends, tokenizer, schema, [{"n": 9, "c": True, "t": {"v": 1, "next": {"v": 2}}}],
           [{"n": 10, "c": True, "t": {"v": 1}}, {"n": 1, "c": 1, "t": {"v": 1}}, {"n": 1, "c": True, "t": {"next": {}}}],
           names=("llguidance", "xgrammar"))  # outlines-core refuses recursion


def test_one_of_beside_any_of_and_all_of_is_intersected_exactly(backends, tokenizer):
    # OpenAI's own tool_choice: a mode, or a named function; exactly one of "a string" or "an object"
    tool_choice = {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                             {"type": "object", "required": ["type", "function"], "additionalProperties": False,
                              "properties": {"type": {"const": "function"}, "function": {
                                  "type": "object", "required": ["name"], "additionalProperties": False,
                                  "properties": {"name": {"type": "string", "maxLength": 8}}}}}],
                   "oneOf": [{"type": "string"}, {"type": "object"}]}
    _check(backends, tokenizer, tool_choice, ["auto", {"type": "function", "function": {"name": "f"}}],
           ["maybe", {"type": "function"}, 3], names=("llguidance", "xgrammar"))
    # the pairs that remain: (a or b) and exactly one of (a, c)
    pairs = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
             "additionalProperties": False, "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
             "oneOf": [{"required": ["a"]}, {"required": ["c"]}]}
    _check(backends, tokenizer, pairs, [{"a": 1}, {"b": "x", "c": True}, {"a": 1, "b": "x"}],
           [{"a": 1, "c": True}, {"b": "x"}, {"c": True}], names=("llguidance", "xgrammar"))
    # beside allOf: the parts merged, then the branches
    merged = {"allOf": [{"type": "object", "properties": {"k": {"type": "integer", "minimum": 0}}, "required": ["k"]}],
              "oneOf": [{"properties": {"k": {"maximum": 3}}}, {"properties": {"k": {"minimum": 10}}}],
              "anyOf": [{"properties": {"k": {"maximum": 11}}}]}
    _check(backends, tokenizer, merged, [{"k": 0}, {"k": 11}], [{"k": 5}, {"k": 12}, {"k": -1}],
           names=("llguidance", "xgrammar"))
