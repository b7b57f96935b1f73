"""The JSON-schema policy and the grammars' soundness, without a model: keywords a backend would ignore are
refused, narrowings admit only valid documents, exact rewrites keep the meaning, and every instance the corpus
labels invalid is refused by each backend's compiled grammar; formats are exact."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from schema_corpus import accepts, compact, corpus


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
    "oneOf by a property's object values": {"type": "object", "oneOf": [
        {"properties": {"a": {"type": "object", "properties": {"k": {"enum": ["x"]}}, "required": ["k"]},
                        "v": {"type": "string", "maxLength": 3}}},
        {"properties": {"a": {"type": "object", "properties": {"k": {"enum": ["y"]}}, "required": ["k"]},
                        "v": {"type": "integer"}}}]},
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
    "not of anything": {"type": "object", "properties": {"gone": {"not": {}}, "n": {"type": "integer"}}},
    "a patternProperty of true": {"type": "object", "patternProperties": {"f.*": True, "b.*": {"type": "integer"}}},
    "a $dynamicRef in one resource": {"$id": "https://example.com/root", "type": "array",
                                      "items": {"$dynamicRef": "#it"},
                                      "$defs": {"s": {"$dynamicAnchor": "it", "type": "string", "maxLength": 4}}},
    "oneOf of strings told apart by length": {"type": "string", "oneOf": [{"maxLength": 0},
                                                                          {"minLength": 1, "maxLength": 5}]},
    "oneOf of numbers told apart by range": {"oneOf": [{"type": "integer", "maximum": 0},
                                                       {"type": "number", "exclusiveMinimum": 0, "maximum": 9}]},
    "draft 7 ignores what stands beside $ref": {  # a recursive $ref with siblings, which llguidance refuses
        "$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/n", "definitions": {"n": {
            "type": "object", "properties": {"k": {"$ref": "#/definitions/n", "type": ["boolean", "object"]},
                                             "s": {"type": "string", "maxLength": 3}}}}},
    "a negative lookahead of prefixes": {"type": "string", "pattern": "^(?!lucene\\.|builtin\\.)[a-z.]{1,12}$"},
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
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        check = cls(schema, format_checker=cls.FORMAT_CHECKER)
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


def test_lookahead_of_prefixes_as_two_patterns():
    """`^(?!p1|p2)rest` is, for every string, the intersection of `^rest` and the trie-spelled "starts with
    neither" (Python's re, which has lookahead, is the judge); other lookaheads are left alone."""
    from plait.runtime.constrained.lookahead import split_negative_prefixes

    rng = random.Random(0)
    for pattern, words in ((r"^(?!^lucene\.|builtin\.|mongodb\.).*", ["lucene.", "builtin.", "mongodb.", "luce"]),
                           (r"^(?!ab|a|x-)[a-z-]{0,5}$", ["ab", "a", "x-", "x", "b"]),
                           (r"^(?!org\.bukkit\.)([a-z_$][a-z0-9_$]*\.)*[a-z_$]+$", ["org.bukkit.", "org.bukkit"])):
        rest, first = map(re.compile, split_negative_prefixes(pattern))
        whole, alphabet = re.compile(pattern), "".join(sorted(set("".join(words)))) + "z9-\n"
        for _ in range(5000):
            text = rng.choice(words + [""]) + "".join(rng.choice(alphabet) for _ in range(rng.randrange(5)))
            assert bool(whole.search(text)) == bool(rest.search(text) and first.search(text)), (pattern, text)
    assert split_negative_prefixes(r"^(?!\d)x") is None and split_negative_prefixes(r"(?!a)b") is None


def test_older_drafts_tuple_items_are_enforced(backends, tokenizer):
    """Draft 7's tuple `items` is rewritten to `prefixItems`, and the sender's `$schema` is dropped with it:
    a backend told draft 7 reads `prefixItems` as an unknown word and would let any second item through."""
    from plait.runtime.constrained import GrammarError
    from plait.runtime.constrained.schema_policy import rewrite_schema

    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
              "items": [{"type": "string", "maxLength": 4}, {"type": "object", "required": ["n"]}]}
    assert "$schema" not in rewrite_schema(schema, "llguidance")[0]
    for name in ("xgrammar", "llguidance"):
        try:
            m = backends[name].compile("json_schema", json.dumps(schema)).matcher()
        except GrammarError:
            continue
        ids = tokenizer.encode('["a", "b"]', add_special_tokens=False)
        assert not all(m.accept_token(t) for t in ids), name


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
    from plait.runtime.constrained.compile_worker import IsolatedCompiler, WorkerConfig
    from plait.runtime.server_args import ServerArgs, default_model_path

    rows = corpus()
    timeout = ServerArgs().grammar_compile_timeout
    accepted = {}
    for name, backend in backends.items():
        compiler = IsolatedCompiler(backend, WorkerConfig(name, default_model_path()), timeout)
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
            text = compact(t["data"], separators)
            ok = accepts(g, tokenizer, text)
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
                if accepts(g, tokenizer, json.dumps(v)):
                    assert checker.conforms(v, fmt), f"{name} {fmt}: accepts {v!r}, which the checker rejects"
            if fmt in FORMAT_TYPICAL:
                assert accepts(g, tokenizer, json.dumps(FORMAT_TYPICAL[fmt])), (name, fmt)
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
        assert accepts(compact, tokenizer, text) and not accepts(compact, tokenizer, indented), name
        assert accepts(flexible, tokenizer, indented), name
        assert not accepts(flexible, tokenizer, '{"a": 1,' + " " * 40 + '"b": true}'), name  # a bounded gap
    any_order = backends["xgrammar"].compile("json_schema", schema, JsonStyle("compact", "any"))
    compact = backends["xgrammar"].compile("json_schema", schema, JsonStyle("compact"))
    assert accepts(any_order, tokenizer, reordered) and not accepts(compact, tokenizer, reordered)
    with pytest.raises(ValueError, match="json_whitespace"):
        JsonStyle("pretty")
    with pytest.raises(GrammarError):
        backends["llguidance"].compile("json_schema", json.dumps({"type": "array", "uniqueItems": True}),
                                       JsonStyle(narrow=False))


