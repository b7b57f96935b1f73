"""Structured output on the real model: JSON schemas from real projects (validated with
jsonschema, formats included), regexes, EBNF grammars, jump-forward equivalence, errors; and,
without a model, soundness of the grammars against the corpus's labelled instances."""

from __future__ import annotations

import json
import os
import random
import re
import time

import jsonschema
import pytest
import torch

from conftest import THREADS

# a copy of shared/schemas (real-world schemas with labelled instances; sources in LICENSES.md)
CORPUS = os.path.join(os.path.dirname(__file__), "data", "schemas", "corpus.jsonl")


def corpus(every: int = 1) -> list[dict]:
    with open(CORPUS) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[::every]


def validator(row: dict):
    cls = getattr(jsonschema, row["draft"] + "Validator")
    cls = jsonschema.validators.extend(cls, {"multipleOf": _multiple_of(cls.VALIDATORS["multipleOf"])})
    return cls(row["schema"], format_checker=cls.FORMAT_CHECKER)


def _multiple_of(check):
    """multipleOf decided exactly, in fractions of the decimal texts, as JSON Schema defines it (the division
    gives an integer). jsonschema divides in floats: 2.51 / 0.01 is 250.99999999999997 there, so it refuses
    2.51 for multipleOf 0.01, and an integer of hundreds of digits (the model writes some) overflows."""
    from fractions import Fraction

    def multiple_of(validator, divisor, instance, schema):
        if not validator.is_type(instance, "number"):
            return
        if (Fraction(str(instance)) / Fraction(str(divisor))).denominator != 1:
            yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor}")
    return multiple_of


def schema_prompt(tokenizer, row: dict) -> str:
    text = json.dumps(row["schema"])
    if len(text) > 600:
        text = text[:600] + " ..."
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write one JSON document that follows this JSON schema:\n{text}"}],
        tokenize=False, add_generation_prompt=True)


# ---- no model: the keyword policy and the grammars' soundness ------------------------------------
def test_policy_rejects_what_backends_would_ignore():
    from plait.runtime.constrained import GrammarError
    from plait.runtime.constrained.schema_policy import prepare_schema

    with pytest.raises(GrammarError, match=r"'uniqueItems' at #/properties/tags/uniqueItems"):
        prepare_schema({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "xgrammar",
                       narrow=False)
    with pytest.raises(GrammarError, match=r"'not' at #/not"):
        prepare_schema({"not": {"type": "string"}}, "xgrammar", narrow=False)
    with pytest.raises(GrammarError, match=r"'not' at #/not"):  # no narrowing known for it
        prepare_schema({"type": "string", "not": {"pattern": "^a"}}, "xgrammar")
    with pytest.raises(GrammarError, match="'minimum'"):
        prepare_schema({"type": "integer", "minimum": 3}, "outlines")
    with pytest.raises(GrammarError, match="oneOf"):  # 1 is both an integer and a number
        prepare_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "xgrammar")
    with pytest.raises(GrammarError, match="not valid JSON"):
        prepare_schema("{nope", "xgrammar")
    # exact rewrites
    s = prepare_schema({"oneOf": [{"type": "string"}, {"type": "object", "properties": {}}]}, "xgrammar")
    assert "anyOf" in s and "oneOf" not in s
    s = prepare_schema({"oneOf": [{"properties": {"k": {"const": "a"}}, "required": ["k"]},
                                  {"properties": {"k": {"const": "b"}}, "required": ["k"]}]}, "xgrammar")
    assert len(s["anyOf"]) == 2
    s = prepare_schema({"type": "integer", "minimum": 2, "exclusiveMinimum": True}, "xgrammar")  # draft 4
    assert s == {"type": "integer", "exclusiveMinimum": 2}
    s = prepare_schema({"allOf": [{"type": "integer"}, {"maximum": 9}]}, "xgrammar")
    assert s == {"type": "integer", "maximum": 9}


# one schema per narrowing (schema_policy.py): no backend enforces these keywords, so each is enforced
# as a stricter schema whose every document is valid for the original
NARROWED = {
    "unevaluatedProperties beside anyOf": {
        "type": "object", "properties": {"k": {"type": "integer"}}, "unevaluatedProperties": False,
        "anyOf": [{"properties": {"a": {"type": "string", "maxLength": 3}}},
                  {"properties": {"b": {"type": "boolean"}}}]},
    "format regex beside a pattern": {"type": "string", "format": "regex", "pattern": "^[a-z]{0,8}$"},
    "contains with minContains and maxContains": {
        "type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}, "minContains": 2, "maxContains": 3},
    "contains beside prefixItems": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 6}],
                                    "contains": {"const": "x"}},
    "oneOf of a value and the type that admits it": {"oneOf": [{"enum": ["linux"]},
                                                               {"type": "string", "maxLength": 9}]},
    "uniqueItems": {"type": "array", "items": {"type": "string", "maxLength": 8}, "uniqueItems": True},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentRequired": {"a": ["b"]}, "additionalProperties": False},
    "dependentSchemas": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                         "required": ["b"], "dependentSchemas": {"a": {"not": {"required": ["b"]}}}},
    "if/then/else": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "meows": {"type": "boolean"}},
                     "required": ["kind"], "additionalProperties": False,
                     "if": {"properties": {"kind": {"const": "cat"}}}, "then": {"required": ["meows"]},
                     "else": {"not": {"required": ["meows"]}}},
    "allOf of if/then": {"type": "object", "properties": {"t": {"type": "string"}, "n": {"type": "integer"}},
                         "allOf": [{"if": {"properties": {"t": {"const": "a"}}}, "then": {"required": ["n"]}},
                                   {"if": {"properties": {"t": {"const": "b"}}},
                                    "then": {"properties": {"n": {"maximum": 3}}}}]},
    "not required": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                     "not": {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}},
    "not type": {"not": {"type": ["string", "object", "array"]}},
    "not enum": {"type": "object", "properties": {
        "n": {"type": "integer", "maximum": 9, "not": {"enum": [0, 1]}},
        "s": {"type": "string", "maxLength": 4, "not": {"const": "ab"}},
        "e": {"enum": ["x", "y", "z"], "not": {"const": "y"}}}, "required": ["n", "s", "e"]},
    "oneOf by required names": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
    "oneOf by a discriminator": {"type": "array", "items": {"oneOf": [
        {"type": "object", "properties": {"k": {"enum": ["x"]}, "v": {"type": "string", "maxLength": 4}}},
        {"type": "object", "properties": {"k": {"enum": ["y", "z"]}, "v": {"type": "boolean"}}}]}},
    "oneOf of closed objects": {"oneOf": [  # `{}` is in both
        {"type": "object", "properties": {"ps": {"type": "string"}}, "additionalProperties": False},
        {"type": "object", "properties": {"sh": {"type": "string"}}, "additionalProperties": False}]},
    "propertyNames": {"type": "object", "properties": {"x1": {"type": "integer"}, "zz": {"type": "integer"}},
                      "propertyNames": {"pattern": "^x[0-9]$"}, "additionalProperties": {"type": "boolean"},
                      "maxProperties": 3},
    "allOf of nots": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "allOf": [{"not": {"required": ["a"]}}, {"not": {"required": ["b"]}}]},
    "oneOf with a branch left out": {  # {radius, height} matches the second branch and the third
        "type": "object", "properties": {"length": {"type": "integer"}, "radius": {"type": "integer"},
                                         "height": {"type": "integer"}},
        "oneOf": [{"required": ["length"]}, {"required": ["radius"]}, {"required": ["radius", "height"]}]},
    "oneOf from an allOf part": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
         "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {"properties": {"c": {"type": "boolean"}}, "required": ["c"]}]},
    "propertyNames beside patternProperties": {
        "type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": 2,
        "patternProperties": {".*": {"type": "object", "properties": {"to": {"type": "string", "maxLength": 6}},
                                     "required": ["to"], "additionalProperties": False}}},
    "format regex": {"type": "object", "properties": {"re": {"type": "string", "format": "regex"},
                                                      "iri": {"type": "string", "format": "iri"}},
                     "required": ["re", "iri"]},
}
# and exact rewrites of keywords no backend takes as they are
REWRITTEN = {
    "unevaluatedProperties beside properties": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
    "unevaluatedItems after a prefix": {
        "type": "array", "prefixItems": [{"type": "string", "maxLength": 3}], "unevaluatedItems": {"type": "integer"}},
    "an allOf part's own unevaluatedProperties": {"allOf": [
        {"properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
        {"properties": {"b": {"type": "string"}}}]},
    "items beside an allOf part's prefixItems": {"type": "array", "allOf": [{"prefixItems": [{"minimum": 3}]}],
                                                "items": {"type": "integer", "minimum": 5, "maximum": 9}},
    "two patterns": {"allOf": [{"type": "string", "pattern": "^a[a-z]{0,6}$"}, {"pattern": "b$"}]},
    "enum values of another type than `type`": {
        "type": "object", "properties": {"r": {"type": "array", "enum": ["code", "token"]}, "n": {"type": "integer"}},
        "required": ["n"]},
    "allOf whose values clash, in an anyOf branch": {"anyOf": [
        {"allOf": [{"enum": ["a", "b"]}, {"const": "c"}]}, {"type": "integer", "minimum": 0, "maximum": 9}]},
    "a required name matched by patternProperties": {
        "type": "object", "patternProperties": {"^x-": {"type": "integer", "maximum": 3}}, "required": ["x-a"],
        "additionalProperties": False},
    "oneOf told apart by a discriminator the parent requires": {
        "type": "object", "required": ["v"], "oneOf": [
            {"allOf": [{"properties": {"v": {"const": 1}}}, {"properties": {"a": {"type": "string", "maxLength": 4}}}]},
            {"allOf": [{"properties": {"v": {"const": 2}}}, {"properties": {"b": {"type": "integer"}}}]}]},
    "oneOf whose branch is an anyOf": {"oneOf": [{"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
                                                 {"type": "integer"}]},
    "oneOf of values and a format": {"oneOf": [{"enum": ["none", "auto"]}, {"type": "string", "format": "uri"}]},
    "allOf with additionalProperties": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"a": {"maximum": 5}, "b": {"type": "boolean"}}, "additionalProperties": False}]},
    "allOf of anyOfs": {"allOf": [{"anyOf": [{"type": "integer", "maximum": 3}, {"type": "string", "maxLength": 2}]},
                                  {"anyOf": [{"type": "integer", "minimum": 1}, {"const": "ab"}]}]},
    "oneOf of one": {"oneOf": [{"type": "integer", "minimum": 5}]},
    "keywords of two types": {"minLength": 2, "maxLength": 3, "minimum": 10},
    "if/then/else on a pinned property": {
        "type": "object", "properties": {"kind": {"enum": ["cat", "dog", "owl"]}, "meows": {"type": "boolean"}},
        "required": ["kind"], "additionalProperties": False,
        "if": {"properties": {"kind": {"const": "cat"}}}, "then": {"required": ["meows"]},
        "else": {"properties": {"meows": False}}},
}


def _random_documents(g, vocab, tokenizer, n: int) -> list[str]:
    """n documents of a compiled grammar: up to 24 random allowed tokens each, then the closing search's
    completion (closing.py)."""
    from plait.runtime.constrained.bitmask import allocate_bitmask, unpack_bitmask
    from plait.runtime.constrained.closing import plan_close

    docs, bitmask = [], allocate_bitmask(1, 49152)
    for seed in range(n):
        rng, m, ids = random.Random(seed), g.matcher(), []
        for _ in range(rng.randrange(24)):
            m.fill_bitmask(bitmask, 0)
            allowed = [t for t in unpack_bitmask(bitmask, 49152)[0].nonzero().flatten().tolist()
                       if t != tokenizer.eos_token_id]
            if not allowed:
                break
            ids.append(rng.choice(allowed))
            assert m.accept_token(ids[-1])
        plan = plan_close(m, vocab, tokenizer.decode(ids), 256)
        assert plan is not None, tokenizer.decode(ids)
        docs.append(tokenizer.decode(ids + plan))
    return docs


def test_narrowings_admit_only_valid_documents(backends, tokenizer):
    """Each narrowing is refused without narrowing (each exact rewrite needs none), and every document
    the grammar admits (random walks through it, then completed) is valid for the schema as sent,
    formats included."""
    from plait.runtime.constrained import GrammarError
    from plait.runtime.constrained.closing import CloseVocab
    from plait.runtime.constrained.schema_policy import prepare_schema, rewrite_schema

    vocab = CloseVocab.from_tokenizer(tokenizer, 49152, [tokenizer.eos_token_id])
    for what, schema in {**NARROWED, **REWRITTEN}.items():
        if what in NARROWED:
            with pytest.raises(GrammarError):
                prepare_schema(schema, "llguidance", narrow=False)
        else:
            assert not rewrite_schema(schema, "llguidance")[1], what  # exact: no narrowing
        check = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        compiled = 0
        for name in ("xgrammar", "llguidance"):
            try:
                g = backends[name].compile("json_schema", json.dumps(schema))
            except GrammarError:
                continue
            compiled += 1
            for doc in _random_documents(g, vocab, tokenizer, 5):
                errors = [e.message for e in check.iter_errors(json.loads(doc))]
                assert not errors, (what, name, doc, errors)
        assert compiled, what


def test_what_no_value_satisfies_is_refused_and_overlaps_are_named():
    """A schema no value satisfies is refused as such; an overlapping oneOf names the two branches."""
    from plait.runtime.constrained import GrammarError
    from plait.runtime.constrained.schema_policy import prepare_schema, rewrite_schema

    for schema in ({"type": "string", "enum": [1, 2]}, {"allOf": [{"const": "a"}, {"const": "b"}]},
                   {"type": "object", "properties": {"k": {"type": "null", "const": 0}}, "required": ["k"]}):
        with pytest.raises(GrammarError, match="no value satisfies"):
            prepare_schema(schema, "llguidance")
    with pytest.raises(GrammarError, match="branches 0 and 1 may both match"):
        prepare_schema({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "llguidance", narrow=False)
    # Java's Long bounds: llguidance builds no regex for them, so they are brought within 2**62 (a narrowing)
    schema, notes = rewrite_schema({"type": "integer", "minimum": -2 ** 63, "maximum": 2 ** 63 - 1}, "llguidance")
    assert (schema["minimum"], schema["maximum"]) == (-2 ** 62, 2 ** 62) and len(notes) == 2


def test_property_counts_never_require_a_recursive_property(backends, tokenizer):
    """llguidance's minProperties is narrowed to listed properties required: requiring `and` (listed first,
    an array of the object itself) would leave no finite document, and the grammar would reach a dead end
    after `{"`; a plain property is required instead."""
    from plait.runtime.constrained.closing import CloseVocab
    from plait.runtime.constrained.schema_policy import rewrite_schema

    schema = {"$ref": "#/definitions/C", "definitions": {"C": {
        "type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
            "and": {"type": "array", "items": {"$ref": "#/definitions/C"}, "minItems": 1},
            "not": {"$ref": "#/definitions/C"}, "title": {"type": "string", "maxLength": 8}}}}}
    narrowed, notes = rewrite_schema(schema, "llguidance")
    assert narrowed["definitions"]["C"]["required"] == ["title"] and notes
    vocab = CloseVocab.from_tokenizer(tokenizer, 49152, [tokenizer.eos_token_id])
    g = backends["llguidance"].compile("json_schema", json.dumps(schema))
    for doc in _random_documents(g, vocab, tokenizer, 8):
        assert not list(jsonschema.Draft7Validator(schema).iter_errors(json.loads(doc))), doc


@pytest.fixture(scope="module")
def backends(tokenizer):
    from plait.runtime.constrained import create_backend

    eos = [tokenizer.eos_token_id]
    return {name: create_backend(name, tokenizer, 49152, eos) for name in ("xgrammar", "llguidance", "outlines")}


def _compact(data, separators: tuple[str, str] = (", ", ": ")) -> str:
    return json.dumps(data, ensure_ascii=False, separators=separators)  # the compact style's: ", " and ": "


def _accepts(g, tokenizer, text: str) -> bool:
    m = g.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(m.accept_token(i) for i in ids) and m.accept_token(tokenizer.eos_token_id)


def test_corpus_soundness_without_a_model(backends, tokenizer):
    """For each backend, every instance the corpus labels invalid is refused by the compiled grammar
    (an accepted one would mean a keyword is silently dropped); valid instances are mostly accepted
    (key order is the schema's, so some are refused). `auto` takes the first backend that compiles a
    schema, so it accepts their union. Every sixth schema here; the whole corpus, outlines-core too,
    in `make test-slow`."""
    rows = corpus(every=6)
    accepted = {name: _check_soundness(backends[name], tokenizer, rows) for name in ("xgrammar", "llguidance")}
    assert len(accepted["xgrammar"]) >= 20 and len(accepted["llguidance"]) >= 20
    union = accepted["xgrammar"] | accepted["llguidance"]
    print(f"auto: {len(union)}/{len(rows)}")
    assert len(union) >= 30  # 34 of these 50 when written (xgrammar alone 27)


@pytest.mark.slow
def test_full_corpus_soundness_without_a_model(backends, tokenizer):
    """Compiled as the server compiles: in a compile worker, within the server's compile timeout (outlines-core
    takes 30-50 s and 3 GB for some of these schemas; compiled in this process one after another, they took the
    whole machine's memory)."""
    from plait.runtime.constrained.compile_worker import IsolatedCompiler, WorkerConfig, tokenizer_files
    from plait.runtime.server_args import ServerArgs

    rows = corpus()
    files, timeout = tokenizer_files(tokenizer), ServerArgs().grammar_compile_timeout
    accepted = {}
    for name, backend in backends.items():
        compiler = IsolatedCompiler(backend, WorkerConfig(name, files, 49152, [tokenizer.eos_token_id]), timeout)
        try:
            accepted[name] = _check_soundness(backend, tokenizer, rows, compiler)
        finally:
            compiler.close()
    assert len(accepted["xgrammar"]) >= 120 and len(accepted["llguidance"]) >= 150
    print(f"auto: {len(set().union(*accepted.values()))}/{len(rows)}")


def _check_soundness(backend, tokenizer, rows: list[dict], compiler=None) -> set[str]:
    """The ids of the schemas the backend compiles (in this process, or with `compiler`, a compile_worker
    IsolatedCompiler); asserts none accepts an invalid instance."""
    from plait.runtime.constrained import GrammarError
    from plait.runtime.constrained.base import JsonStyle

    # outlines-core puts its whitespace pattern on both sides of every separator, so its compact style has none
    separators = (",", ":") if backend.name == "outlines" else (", ", ": ")
    compiled, valid_ok, valid_all = set(), 0, 0
    for row in rows:
        try:
            text = json.dumps(row["schema"])
            g = (backend.compile("json_schema", text) if compiler is None
                 else compiler.compile("json_schema", text, JsonStyle(), lambda: None))
        except GrammarError as e:
            assert str(e), row["id"]
            continue
        compiled.add(row["id"])
        for t in row["tests"]:
            text = _compact(t["data"], separators)
            ok = _accepts(g, tokenizer, text)
            if t["valid"]:
                valid_all += 1
                valid_ok += ok
            else:
                assert not ok, f"{backend.name} {row['id']}: the grammar accepts an invalid instance {text[:200]}"
    print(f"\n{backend.name}: {len(compiled)}/{len(rows)} compiled; valid instances accepted {valid_ok}/{valid_all}")
    assert valid_ok >= valid_all // 3
    return compiled


# values around each format's edges; the checker's verdict is the truth (jsonschema's format checker)
FORMAT_CASES = {
    "date": ["2021-02-28", "2021-02-29", "2020-02-29", "1900-02-29", "2000-02-29", "2400-02-29", "0004-02-29",
             "0000-02-29", "0000-01-01", "2021-04-30", "2021-04-31", "2021-06-31", "2021-12-31", "2021-13-01",
             "2021-00-10", "2021-01-00", "2021-1-01", "20210101", "9999-12-31"],
    "time": ["12:00:00Z", "12:00:00z", "12:00:00", "23:59:59Z", "23:59:60Z", "24:00:00Z", "00:00:00+00:00",
             "12:00:00+01:00", "12:00:00-23:59", "12:00:00+24:00", "12:00:00.123Z", "12:00:00.Z", "12:60:00Z",
             "12:00Z", "1:00:00Z"],
    "date-time": ["2021-02-28T12:00:00Z", "2021-02-29T12:00:00Z", "2020-02-29T00:00:00+05:30",
                  "2021-01-01t12:00:00z", "2021-01-01 12:00:00Z", "2021-01-01T12:00:00", "2021-01-01T23:59:60Z",
                  "2021-04-31T10:00:00Z", "2021-01-01T12:00:00.5-08:00"],
    "email": ["a@b.co", "a@b", "first.last@example.org", "ab.com", "@", "a@b@c"],
    "ipv4": ["1.2.3.4", "0.0.0.0", "255.255.255.255", "256.1.1.1", "01.2.3.4", "1.2.3.04", "1.2.3", "1.2.3.4.5"],
    "ipv6": ["::1", "::", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::", "fe80::1", "1:2:3:4:5:6:7:8:9", "1::2::3",
             "12345::1", "fe80::1%eth0", "::ffff:1.2.3.4", "::1.2.3.4", "1:2:3:4:5:6:7:1.2.3.4", ":1"],
    "hostname": ["example.com", "a", "xn--bcher-kva.ch", "1.2.3.4", "example.com.", "-a.com", "a-.com", "a..com",
                 "ex_ample.com", "a" * 63 + ".com", "a" * 64 + ".com", ".".join(["b" * 63] * 4) + ".com"],
    "uuid": ["123e4567-e89b-12d3-a456-426614174000", "123E4567-E89B-12D3-A456-426614174000",
             "123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g",
             "{123e4567-e89b-12d3-a456-426614174000}"],
    "duration": ["P1D", "PT1H", "P1Y2M3DT4H5M6S", "P1W", "P", "PT", "P1DT", "1D", "P1W1D"],
    "uri": ["http://a.com", "urn:isbn:1234", "mailto:a@b.com", "http:", "a.com", "http://a b.com", "//a.com"],
    "uri-reference": ["http://a.com", "/a/b", "a/b?c#d", "", "http://a b.com", "\\a"],
    "iri-reference": ["/a/b", "", "a b", "//x"],
    "regex": ["a", "", "a b", "[", "(a", "a-b_c"],
    "iri": ["http://a.com", "a.com", "http://a b.com"],
    "idn-email": ["a@b.co", "ab.com"],
    "idn-hostname": ["example.com", "-a.com", "a" * 64 + ".com"],
}
# values a backend must also accept where it enforces the format (each one well inside it)
FORMAT_TYPICAL = {"date": "2024-02-29", "time": "08:30:00Z", "date-time": "2024-02-29T08:30:00+01:00",
                  "ipv4": "192.168.0.1", "hostname": "example.com", "uuid": "123e4567-e89b-12d3-a456-426614174000"}


def test_formats_are_exact_for_every_backend(backends, tokenizer):
    """Each format a backend enforces (natively, or as one of formats.py's exact patterns) admits no
    value jsonschema's format checker rejects, leap days, month ends, leap seconds, time zones and IPv6
    forms included; a format a backend cannot enforce exactly is refused by name."""
    from plait.runtime.constrained import GrammarError

    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    enforced = {}
    for name, backend in backends.items():
        enforced[name] = []
        for fmt, values in FORMAT_CASES.items():
            try:
                g = backend.compile("json_schema", json.dumps({"type": "string", "format": fmt}))
            except GrammarError as e:
                assert f"format {fmt!r}" in str(e), (name, fmt, str(e))
                continue
            enforced[name].append(fmt)
            for v in values:
                if _accepts(g, tokenizer, json.dumps(v)):
                    assert checker.conforms(v, fmt), f"{name} {fmt}: accepts {v!r}, which the checker rejects"
            if fmt in FORMAT_TYPICAL:
                assert _accepts(g, tokenizer, json.dumps(FORMAT_TYPICAL[fmt])), (name, fmt)
    print("\nformats enforced:", enforced)
    assert {"date", "time", "date-time", "ipv4", "hostname", "ipv6", "uuid"} <= set(enforced["llguidance"])
    assert {"date", "time", "date-time", "ipv4", "uuid"} <= set(enforced["xgrammar"])


def test_json_style_whitespace_and_key_order(backends, tokenizer):
    from plait.runtime.constrained import GrammarError, JsonStyle

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                         "required": ["a", "b"], "additionalProperties": False})
    indented, reordered = '{\n  "a": 1,\n  "b": true\n}', '{"b": true, "a": 1}'
    for name in ("xgrammar", "llguidance", "outlines"):
        compact = backends[name].compile("json_schema", schema, JsonStyle("compact"))
        flexible = backends[name].compile("json_schema", schema, JsonStyle("flexible"))
        text = '{"a":1,"b":true}' if name == "outlines" else '{"a": 1, "b": true}'  # outlines: no spaces at all
        assert _accepts(compact, tokenizer, text) and not _accepts(compact, tokenizer, indented), name
        assert _accepts(flexible, tokenizer, indented), name
        assert not _accepts(flexible, tokenizer, '{"a": 1,' + " " * 40 + '"b": true}'), name  # a bounded gap
    any_order = backends["xgrammar"].compile("json_schema", schema, JsonStyle("compact", "any"))
    compact = backends["xgrammar"].compile("json_schema", schema, JsonStyle("compact"))
    assert _accepts(any_order, tokenizer, reordered) and not _accepts(compact, tokenizer, reordered)
    with pytest.raises(ValueError, match="json_whitespace"):
        JsonStyle("pretty")
    with pytest.raises(GrammarError):
        backends["llguidance"].compile("json_schema", json.dumps({"type": "array", "uniqueItems": True}),
                                       JsonStyle(narrow=False))


def test_a_speculative_guess_stops_short_of_the_grammars_end(backends, tokenizer):
    """A verify has no row to pick from after the grammar's end, so a guess is cut before the token that ends it
    (the model picks that token itself); a forced or plain prefix check still takes it."""
    from plait.runtime.constrained.jump_forward import allowed_prefix

    ids = tokenizer.encode('{"name": "Ann", "age": 3, "city": "Paris", "tags": []}', add_special_tokens=False)
    ids.append(tokenizer.eos_token_id)
    for name in ("xgrammar", "llguidance"):
        m = backends[name].compile("json_schema", json.dumps(PERSON)).matcher()
        n = allowed_prefix(m, ids, before_end=True)
        assert n < allowed_prefix(m, ids) and m.jump_forward_string() == '{"name": "', name  # left unchanged
        assert all(m.accept_token(i) for i in ids[:n]) and not m.is_terminated(), name
        assert m.accept_token(ids[n]) and m.is_terminated(), name


def test_llguidance_matcher_contract(backends, tokenizer):
    """Refused tokens leave the state as it was; rollback, copy, jump-forward text and the end (EOS
    taken where llguidance has stopped by itself) behave as xgrammar's matcher does."""
    g = backends["llguidance"].compile("json_schema", json.dumps(PERSON))
    m = g.matcher()
    assert m.jump_forward_string() == '{"name": "'
    ids = tokenizer.encode('{"name": "Ann", "age": 3', add_special_tokens=False)
    assert all(m.accept_token(i) for i in ids)
    bad = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not m.accept_token(bad) and m.accept_token(tokenizer.encode(",", add_special_tokens=False)[0])
    m.rollback(1)
    twin = m.copy()
    rest = tokenizer.encode(', "city": "Paris", "tags": []}', add_special_tokens=False)
    assert all(twin.accept_token(i) for i in rest) and twin.is_terminated()
    assert twin.accept_token(tokenizer.eos_token_id) and not twin.accept_token(tokenizer.eos_token_id)
    twin.rollback(2)  # the EOS and the closing brace
    assert not twin.is_terminated() and twin.accept_token(rest[-1])
    assert not m.is_terminated()  # the copy is independent
    bitmask = torch.zeros(1, (49152 + 31) // 32, dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    assert (int(bitmask[0, comma // 32]) >> (comma % 32)) & 1 and not (int(bitmask[0, bad // 32]) >> (bad % 32)) & 1


SHOP = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "visits": {"type": "integer"},
    "opened": {"type": "string", "format": "date"}, "kind": {"enum": ["bakery", "florist"]},
    "products": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "minLength": 2}, "vegan": {"type": "boolean"}},
              "required": ["name", "vegan"], "additionalProperties": False}},
    "required": ["name", "visits", "opened", "kind", "products", "owner"], "additionalProperties": False}


def test_closing_plans_complete_any_prefix_for_every_backend(backends, tokenizer):
    """From every token boundary of a valid document, the closing search finds a completion that
    validates (formats too) and leaves the matcher as it was; a ClosingMatcher over it, driven by a
    writer that picks at random, ends the document within the budget, valid."""
    from plait.runtime.constrained.bitmask import allocate_bitmask, unpack_bitmask
    from plait.runtime.constrained.closing import ClosingMatcher, CloseVocab, plan_close

    eos = tokenizer.eos_token_id
    vocab = CloseVocab.from_tokenizer(tokenizer, 49152, [eos])
    doc = {"name": "Bakery-Bakery-Bakery-Bakery", "visits": 12, "opened": "2020-02-29", "kind": "bakery",
           "products": ["rye bread", "scones"], "owner": {"name": "Ann", "vegan": True}}
    check = jsonschema.Draft202012Validator(SHOP, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for name, backend in backends.items():
        # outlines-core's compact layout has no spaces at all
        text = json.dumps(doc, separators=(",", ":") if name == "outlines" else (", ", ": "))
        ids = tokenizer.encode(text, add_special_tokens=False)
        g = backend.compile("json_schema", json.dumps(SHOP))
        for k in range(len(ids)):
            m = g.matcher()
            assert all(m.accept_token(i) for i in ids[:k])
            before, after = allocate_bitmask(1, 49152), allocate_bitmask(1, 49152)
            m.fill_bitmask(before, 0)
            prefix = tokenizer.decode(ids[:k])
            # outlines-core forces only chains of single tokens, so its plans spell more out character by character
            plan = plan_close(m, vocab, prefix, 128 if name == "outlines" else 64)
            assert plan is not None, (name, prefix)
            m.fill_bitmask(after, 0)
            assert torch.equal(before, after), (name, prefix)
            closed = prefix + tokenizer.decode(plan)
            assert not list(check.iter_errors(json.loads(closed))), (name, closed)
            if k % 8:
                continue
            # the model (random allowed tokens here) writes on while a completion still fits after its
            # token; a refused token is replaced by the plan's next, the only one the mask then allows
            budget = len(plan) + 2
            closing, rng, out = ClosingMatcher(m, plan, vocab, prefix, budget), random.Random(k), []
            while not closing.is_terminated():
                assert len(out) < budget, (name, closed)
                m.fill_bitmask(before, 0)
                allowed = unpack_bitmask(before, 49152)[0].nonzero().flatten().tolist()
                tok = rng.choice(allowed)
                if not closing.accept_token(tok):
                    closing.fill_bitmask(after, 0)
                    bits = unpack_bitmask(after, 49152)[0].nonzero().flatten().tolist()
                    assert len(bits) == 1 and closing.accept_token(bits[0]), (name, closed, bits)
                    tok = bits[0]
                out.append(tok)
                if tok == eos:
                    break
            text = prefix + tokenizer.decode([t for t in out if t != eos])
            assert not list(check.iter_errors(json.loads(text))), (name, text)
            closing.rollback(len(out))  # back to where the closing began
            assert closing.forced_tokens() == plan


def test_compile_worker_kills_a_runaway_compile_and_rebuilds_what_it_compiled(tokenizer):
    """Scheduler compiles run in a worker process, without torch: each backend's grammar comes back as the one
    compiled here (the same mask). Under auto, a backend whose compile outlives its share of the timeout (its
    worker is killed) or whose worker dies is one more refusal: the next backend compiles it."""
    from plait.runtime.constrained import GrammarCache, create_backend
    from plait.runtime.constrained.compile_worker import IsolatedCompiler, WorkerConfig, spawn_worker, tokenizer_files

    spawned = spawn_worker()  # as the scheduler does: the process starts before its config exists
    backend = create_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id])
    config = WorkerConfig("auto", tokenizer_files(tokenizer), 49152, [tokenizer.eos_token_id])
    cache = GrammarCache(backend, 16, workers=1, new_compiler=lambda: IsolatedCompiler(backend, config, 8.0))
    compiler = cache._compilers[0]
    try:
        cache.warm(spawned)
        cache.wait_warm()
        assert compiler.worker._proc is spawned and compiler.worker._ready
        with open(f"/proc/{spawned.pid}/maps") as maps:  # a worker only compiles: torch stays out of its memory
            assert "libtorch" not in maps.read()
        # a grammar for each backend auto picks: xgrammar (EBNF), llguidance (JSON schemas, regexes), outlines
        # (minProperties, which the others refuse)
        grammars = [("json_schema", json.dumps(PERSON)), ("regex", "[0-9]{2,4}"), ("ebnf", 'root ::= "yes" | "no"'),
                    ("json_schema", json.dumps({"type": "integer", "multipleOf": 3})),
                    ("json_schema", json.dumps({"type": "object", "minProperties": 2,
                                                "properties": {"a": {"type": "integer"}}}))]
        backends_seen = set()
        for kind, text in grammars:
            remote = cache.get(kind, text).future.result(timeout=120)
            local = backend.compile(kind, text)
            assert remote.backend == local.backend
            backends_seen.add(remote.backend)
            masks = torch.zeros(2, (49152 + 31) // 32, dtype=torch.int32)
            remote.matcher().fill_bitmask(masks, 0)
            local.matcher().fill_bitmask(masks, 1)
            assert torch.equal(masks[0], masks[1]) and masks[0].any(), (kind, text)
        assert backends_seen == {"xgrammar", "llguidance", "outlines"}
        # xgrammar compiles this for about 20 s (llguidance in a fraction of one): killed after 1 s (FALL_THROUGH_S)
        t = time.monotonic()
        slow = "root ::= " + " ".join(['"a"?'] * 400)
        assert cache.get("ebnf", slow).future.result(timeout=120).backend == "llguidance"
        assert compiler.worker.restarts == 1 and time.monotonic() - t < 60
        # a worker that dies mid-compile (as a crashing compiler would): the same fall-through
        entry = cache.get("ebnf", slow.replace('"a"', '"b"'))
        while entry.started is None:
            time.sleep(0.05)
        time.sleep(0.5)
        compiler.worker._proc.kill()
        assert entry.future.result(timeout=120).backend == "llguidance"
        assert compiler.worker.restarts == 2
        assert cache.get("json_schema", '{"type": "integer"}').future.result(timeout=120).backend == "llguidance"
    finally:
        cache.close()
    assert compiler.worker._proc.poll() is not None  # closed: no worker left behind


# ---- the real model --------------------------------------------------------------------------
def _generate_corpus(engine, tokenizer, rows, max_new: int, temps=(0.0, 0.7)):
    """Every row at each temperature, all in flight at once. Returns (compiled ids, rejected
    (id, message) pairs, valid outputs); asserts every complete output validates."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(row, temp) for temp in temps for row in rows]

    def run(job):
        row, temp = job
        try:
            return engine.generate(schema_prompt(tokenizer, row), {
                "json_schema": json.dumps(row["schema"]), "temperature": temp, "seed": 7, "max_new_tokens": max_new})
        except ValueError as e:  # refused: must say why
            return e

    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(run, jobs))
    compiled, rejected = set(), {}
    checked = truncated = 0
    for (row, _), out in zip(jobs, outs):
        if isinstance(out, ValueError):
            assert "json_schema" in str(out), (row["id"], str(out))
            rejected[row["id"]] = str(out)
            continue
        compiled.add(row["id"])
        finish = out["meta_info"]["finish_reason"]
        if finish["type"] == "length" and "closed early" not in finish.get("message", ""):
            truncated += 1  # no completion fitted in the tokens left when the closing looked for one
            continue
        assert finish["type"] in ("stop", "length"), (row["id"], out["meta_info"])
        obj = json.loads(out["text"])
        errors = [e.message for e in validator(row).iter_errors(obj)]
        assert not errors, (row["id"], out["text"][:500], errors[:3])
        checked += 1
    print(f"\n{len(compiled)}/{len(rows)} schemas compiled, {len(rejected)} rejected; {checked} outputs valid, "
          f"{truncated} cut by max_new_tokens")
    return compiled, rejected, checked


def test_corpus_schemas_generate_valid_json(engine, tokenizer):
    rows = corpus(every=12)
    compiled, rejected, checked = _generate_corpus(engine, tokenizer, rows, max_new=192)
    assert len(compiled) >= 10 and checked >= 6  # the rest ramble in a string until max_new_tokens
    # a rejected schema is refused fast (the failure is cached) with a message naming the problem
    rid, message = next(iter(rejected.items()))
    schema = next(r["schema"] for r in rows if r["id"] == rid)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="cannot enforce|invalid json_schema|did not compile"):
        engine.generate("x", {"json_schema": json.dumps(schema), "max_new_tokens": 4})
    assert time.perf_counter() - t0 < 2


FULL_SHARDS = 6


@pytest.fixture(scope="module")
def corpus_engine():
    """The full corpus runs up to 1024 new tokens a request: a pool that holds a full batch of them (the
    session engine's 16k tokens hold ~12, which made this test take hours)."""
    from plait import Engine

    eng = Engine(num_threads=THREADS, max_total_tokens=96 * 1024, dtype="float32", log_level="warning")
    yield eng
    eng.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(FULL_SHARDS))
def test_full_corpus_generates_valid_json(corpus_engine, shard):
    """Every schema at both temperatures, in shards that report as they go (each a sixth of the corpus)."""
    _generate_corpus(corpus_engine, corpus_engine.tokenizer, corpus()[shard::FULL_SHARDS], max_new=1024)


REGEXES = {
    "date": r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z][a-z0-9._]{1,15}@[a-z]{2,10}\.(com|org|net)",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "enum": r"(red|green|blue|yellow)",
    "nested": r"((ab|cd)(ef)?){2,3}-(x(y|z){1,4})",
    "int": r"-?(0|[1-9]\d{0,6})",
}


def test_regex_outputs_match(engine, tokenizer):
    prompts, params, names = [], [], []
    for temp in (0.0, 0.9):
        for name, rx in REGEXES.items():
            prompts.append(f"Here is an example {name}: ")
            params.append({"regex": rx, "temperature": temp, "seed": 1, "max_new_tokens": 40})
            names.append(name)
    outs = engine.generate(prompts, params)
    for name, out in zip(names, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (name, out)
        assert re.fullmatch(REGEXES[name], out["text"]), (name, out["text"])
    assert int(outs[5]["text"]) == int(outs[5]["text"].strip())


ARITH = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num (("*" | "/") num)*
num ::= [1-9] [0-9]? | "(" expr ")"
'''
SQL = r'''
root ::= "SELECT " cols " FROM " ident where? ";"
cols ::= "*" | ident (", " ident)*
where ::= " WHERE " ident " " op " " value
op ::= "=" | "<" | ">"
value ::= [0-9]+ | "'" [a-z]+ "'"
ident ::= [a-z_]+
'''
SQL_RE = r"SELECT (\*|[a-z_]+(, [a-z_]+)*) FROM [a-z_]+( WHERE [a-z_]+ [=<>] ([0-9]+|'[a-z]+'))?;"


def _arith_ok(text: str) -> bool:
    # an independent check: Python's own parser accepts it and only these characters occur
    if not re.fullmatch(r"[0-9+\-*/()]+", text):
        return False
    try:
        compile(text, "<expr>", "eval")
        return True
    except SyntaxError:
        return False


def test_ebnf_outputs_match(engine):
    outs = engine.generate(["Arithmetic: ", "Arithmetic: ", "SQL query listing users: ", "SQL: "],
                           [{"ebnf": ARITH, "temperature": t, "seed": 3, "max_new_tokens": 48} for t in (0, 0.8)]
                           + [{"ebnf": SQL, "temperature": t, "seed": 3, "max_new_tokens": 48} for t in (0, 0.8)])
    for out in outs[:2]:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert _arith_ok(out["text"]), out["text"]
        else:  # cut short: still a prefix the grammar allows
            assert re.fullmatch(r"[0-9+\-*/()]+", out["text"]), out["text"]
    for out in outs[2:]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(SQL_RE, out["text"]), out["text"]


def test_grammar_errors_are_clear_and_fast(engine):
    cases = [({"regex": "(a|b"}, "invalid regex"), ({"ebnf": 'root ::= "a" | b'}, "invalid ebnf"),
             ({"json_schema": "{nope"}, "not valid JSON"),
             ({"json_schema": json.dumps({"type": "array", "contains": {"const": 1}, "maxContains": 0})},
              "'contains' at #/contains"),
             ({"regex": "a", "json_schema": "{}"}, "at most one")]
    for params, message in cases:
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.generate("x", {**params, "max_new_tokens": 4})
        assert time.perf_counter() - t0 < 5
    # the engine keeps serving, and a grammar that cannot finish says so
    out = engine.generate("Count: ", {"regex": r"\d{30}", "max_new_tokens": 5, "temperature": 0})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert "grammar" in out["meta_info"]["finish_reason"]["message"]
    assert re.fullmatch(r"\d{5}", out["text"])


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "city": {"enum": ["Paris", "London", "Tokyo", "New York"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"]}


def test_jump_forward_is_exact_and_saves_forwards(engine, tokenizer):
    """Same text and ids with jump-forward on (the session engine) and off, at temperature 0;
    fewer forward passes with it on."""
    from plait import Engine

    prompts = [schema_prompt(tokenizer, {"schema": PERSON}) + f"Person {i}: " for i in range(4)]
    params = {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 96}

    def run(eng):
        before = eng.get_server_info()["forward_passes"]
        outs = [eng.generate(p, params) for p in prompts]  # one at a time: passes count tokens, not batching
        return outs, eng.get_server_info()["forward_passes"] - before

    with_jf, passes_jf = run(engine)
    plain = Engine(num_threads=THREADS, max_total_tokens=4096, dtype="float32", log_level="warning",
                   disable_jump_forward=True)
    try:
        without, passes = run(plain)
    finally:
        plain.shutdown()
    for a, b in zip(with_jf, without):
        assert a["text"] == b["text"] and a["output_ids"] == b["output_ids"]
        json.loads(a["text"])
    print(f"\nforward passes: {passes_jf} with jump-forward, {passes} without")
    assert passes_jf < 0.85 * passes


def test_outlines_backend(tokenizer):
    from plait import Engine

    eng = Engine(num_threads=THREADS, max_total_tokens=4096, dtype="float32", log_level="warning",
                 grammar_backend="outlines")
    try:
        schema = {k: v for k, v in PERSON.items()}
        outs = eng.generate([schema_prompt(tokenizer, {"schema": schema})] * 2 + ["Date: ", "Colour: "],
                            [{"json_schema": json.dumps(schema), "temperature": t, "seed": 5, "max_new_tokens": 96}
                             for t in (0, 0.8)]
                            + [{"regex": REGEXES["date"], "max_new_tokens": 16},
                               {"regex": REGEXES["enum"], "temperature": 0.8, "max_new_tokens": 8}])
        for out in outs[:2]:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
            assert out["meta_info"]["grammar_backend"] == "outlines"
            assert not list(jsonschema.Draft202012Validator(schema).iter_errors(json.loads(out["text"])))
        assert re.fullmatch(REGEXES["date"], outs[2]["text"]) and re.fullmatch(REGEXES["enum"], outs[3]["text"])
        with pytest.raises(ValueError, match="no EBNF"):
            eng.generate("x", {"ebnf": ARITH})
        with pytest.raises(ValueError, match="'minimum'"):
            eng.generate("x", {"json_schema": json.dumps({"type": "integer", "minimum": 1})})
    finally:
        eng.shutdown()


def test_auto_backend_picks_per_request_and_reports_it(engine, tokenizer):
    """The session engine runs --grammar-backend auto: a schema goes to llguidance (compiles in
    milliseconds), unless it asks for keys in any order, which only xgrammar writes; one xgrammar would only
    approximate (multipleOf, a hostname) stays with llguidance even then (as would one xgrammar takes over a
    second to compile); the output validates with the formats checked; the chosen backend is in meta_info."""
    counted = {"type": "object", "properties": {"count": {"type": "integer", "multipleOf": 5, "minimum": 10},
                                                "host": {"type": "string", "format": "hostname"}},
               "required": ["count", "host"], "additionalProperties": False}
    pair = {"type": "object", "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["x", "ok"]}
    cases = [(PERSON, "schema", "llguidance"), (pair, "any", "xgrammar"), (counted, "any", "llguidance")]
    outs = engine.generate([schema_prompt(tokenizer, {"schema": s}) for s, _, _ in cases],
                           [{"json_schema": json.dumps(s), "json_key_order": order, "temperature": 0,
                             "max_new_tokens": 96} for s, order, _ in cases])
    for (schema, _, backend), out in zip(cases, outs):
        assert out["meta_info"]["grammar_backend"] == backend, out["meta_info"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        assert not list(v.iter_errors(json.loads(out["text"]))), out["text"]
    # a keyword no backend enforces: narrowed, said in meta_info, and the output valid for the schema as sent
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                      "uniqueItems": True}}, "required": ["tags"]}
    out = engine.generate(schema_prompt(tokenizer, {"schema": tags}), {
        "json_schema": json.dumps(tags), "temperature": 0, "max_new_tokens": 48})
    assert out["meta_info"]["grammar_narrowed"] == ["uniqueItems as at most one item at #/properties/tags"]
    assert not list(jsonschema.Draft202012Validator(tags).iter_errors(json.loads(out["text"]))), out["text"]
    # per request: flexible whitespace over the server's compact default (the model indents its JSON)
    out = engine.generate(schema_prompt(tokenizer, {"schema": PERSON}), {
        "json_schema": json.dumps(PERSON), "json_whitespace": "flexible", "temperature": 0, "max_new_tokens": 128})
    assert "\n" in out["text"] and json.loads(out["text"])
    with pytest.raises(ValueError, match="json_whitespace"):
        engine.generate("x", {"json_schema": "{}", "json_whitespace": "pretty"})


def test_outputs_near_max_new_tokens_are_closed_and_validate(engine, tokenizer):
    """A budget too small for what the model writes: the grammar is closed in time, so the output parses
    and validates, and says it was cut (finish_reason length with the reason)."""
    before = engine.get_server_info()["grammars_closed"]
    prompt = schema_prompt(tokenizer, {"schema": SHOP})
    params = [{"json_schema": json.dumps(SHOP), "temperature": t, "seed": 3, "max_new_tokens": n}
              for n in (72, 80, 88) for t in (0, 0.9)]
    outs = engine.generate([prompt] * len(params), params)
    check = jsonschema.Draft202012Validator(SHOP, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    closed = 0
    for p, out in zip(params, outs):
        finish = out["meta_info"]["finish_reason"]
        assert out["meta_info"]["completion_tokens"] <= p["max_new_tokens"]
        if finish["type"] == "length" and "closed early" not in finish["message"]:
            continue  # the model's own writing left no room for a completion by the time one was looked for
        closed += finish["type"] == "length"
        assert not list(check.iter_errors(json.loads(out["text"]))), (p, out["text"])
    assert closed >= 4 and engine.get_server_info()["grammars_closed"] - before == closed


RECORDS = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 1, "items": {"type": "object", "required": ["name", "qty", "note"], "properties": {
        "name": {"type": "string"}, "qty": {"type": "integer"}, "note": {"type": "string"}}}}}}


def test_every_budget_that_holds_a_document_ends_with_one(engine, tokenizer):
    """An array of records the model would extend past any budget: one token (`}, {`) lengthens the
    completion by a whole record, so the closing takes over while the longest completion planned still fits.
    Every output parses and validates, whatever the budget, temperature or seed."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "List 30 products with a name, a quantity "
                                             "and a long note each, as JSON."}], tokenize=False,
                                           add_generation_prompt=True)
    params = [{"json_schema": json.dumps(RECORDS), "temperature": t, "seed": seed, "max_new_tokens": n}
              for n in (40, 64, 100) for t, seed in ((0, 0), (0.8, 1), (0.8, 2))]
    outs = engine.generate([prompt] * len(params), params)
    for p, out in zip(params, outs):
        finish = out["meta_info"]["finish_reason"]
        assert finish["type"] == "stop" or finish["message"].startswith("max_new_tokens was near"), (p, out)
        assert not list(jsonschema.Draft202012Validator(RECORDS).iter_errors(json.loads(out["text"]))), out["text"]


def test_llguidance_backend(tokenizer):
    from plait import Engine

    eng = Engine(num_threads=THREADS, max_total_tokens=4096, dtype="float32", log_level="warning",
                 grammar_backend="llguidance")
    try:
        outs = eng.generate([schema_prompt(tokenizer, {"schema": PERSON})] * 2 + ["Date: ", "Colour: ", "SQL: "],
                            [{"json_schema": json.dumps(PERSON), "temperature": t, "seed": 5, "max_new_tokens": 96}
                             for t in (0, 0.8)]
                            + [{"regex": REGEXES["date"], "max_new_tokens": 16},
                               {"regex": REGEXES["enum"], "temperature": 0.8, "max_new_tokens": 8},
                               {"ebnf": SQL, "temperature": 0, "max_new_tokens": 48}])
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
            assert out["meta_info"]["grammar_backend"] == "llguidance"
        for out in outs[:2]:
            assert not list(jsonschema.Draft202012Validator(PERSON).iter_errors(json.loads(out["text"])))
        assert re.fullmatch(REGEXES["date"], outs[2]["text"]) and re.fullmatch(REGEXES["enum"], outs[3]["text"])
        assert re.fullmatch(SQL_RE, outs[4]["text"]), outs[4]["text"]
        with pytest.raises(ValueError, match="backreferences"):
            eng.generate("x", {"json_schema": json.dumps({"type": "string", "pattern": "^(a)\\1$"})})
    finally:
        eng.shutdown()
