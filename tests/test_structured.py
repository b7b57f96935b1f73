"""Structured output on the real model: JSON schemas from real projects (validated with
jsonschema, formats included), regexes, EBNF grammars, jump-forward equivalence, errors; and,
without a model, soundness of the grammars against the corpus's labelled instances."""

from __future__ import annotations

import json
import os
import re
import time

import jsonschema
import pytest

from conftest import THREADS

# a copy of shared/schemas (real-world schemas with labelled instances; sources in LICENSES.md)
CORPUS = os.path.join(os.path.dirname(__file__), "data", "schemas", "corpus.jsonl")


def corpus(every: int = 1) -> list[dict]:
    with open(CORPUS) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[::every]


def validator(row: dict):
    cls = getattr(jsonschema, row["draft"] + "Validator")
    return cls(row["schema"], format_checker=cls.FORMAT_CHECKER)


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
        prepare_schema({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "xgrammar")
    with pytest.raises(GrammarError, match=r"'not' at #/not"):
        prepare_schema({"not": {"type": "string"}}, "xgrammar")
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


@pytest.fixture(scope="module")
def backends(tokenizer):
    from plait.runtime.constrained import create_backend

    eos = [tokenizer.eos_token_id]
    return {name: create_backend(name, tokenizer, 49152, eos) for name in ("xgrammar", "outlines")}


def _compact(data) -> str:
    return json.dumps(data, ensure_ascii=False)  # xgrammar's separators: ", " and ": "


def test_corpus_soundness_without_a_model(backends, tokenizer):
    """Every instance the corpus labels invalid is refused by the compiled grammar (an accepted one
    would mean a keyword is silently dropped); valid instances are mostly accepted (xgrammar fixes
    key order to the schema's and forbids unlisted properties, so some are refused). Every sixth
    schema here; the whole corpus in `make test-slow`."""
    _check_soundness(backends, tokenizer, corpus(every=6), min_compiled=20)


@pytest.mark.slow
def test_full_corpus_soundness_without_a_model(backends, tokenizer):
    _check_soundness(backends, tokenizer, corpus(), min_compiled=120)


def _check_soundness(backends, tokenizer, rows: list[dict], min_compiled: int) -> None:
    from plait.runtime.constrained import GrammarError

    backend = backends["xgrammar"]
    compiled = rejected = valid_ok = valid_all = 0
    for row in rows:
        try:
            g = backend.compile("json_schema", json.dumps(row["schema"]))
        except GrammarError as e:
            rejected += 1
            assert str(e), row["id"]
            continue
        compiled += 1
        for t in row["tests"]:
            m = g.matcher()
            text = _compact(t["data"])
            ids = tokenizer.encode(text, add_special_tokens=False)
            ok = all(m.accept_token(i) for i in ids) and m.accept_token(tokenizer.eos_token_id)
            if t["valid"]:
                valid_all += 1
                valid_ok += ok
            else:
                assert not ok, f"{row['id']}: the grammar accepts an invalid instance {text[:200]}"
    print(f"\nxgrammar: {compiled} compiled, {rejected} rejected; valid instances accepted {valid_ok}/{valid_all}")
    assert compiled >= min_compiled and valid_ok >= valid_all // 3


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
        if out["meta_info"]["finish_reason"]["type"] == "length":
            truncated += 1
            continue
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (row["id"], out["meta_info"])
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


@pytest.mark.slow
def test_full_corpus_generates_valid_json(engine, tokenizer):
    _generate_corpus(engine, tokenizer, corpus(), max_new=1024)


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
             ({"json_schema": json.dumps({"type": "array", "uniqueItems": True})}, "'uniqueItems' at #/uniqueItems"),
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
            assert not list(jsonschema.Draft202012Validator(schema).iter_errors(json.loads(out["text"])))
        assert re.fullmatch(REGEXES["date"], outs[2]["text"]) and re.fullmatch(REGEXES["enum"], outs[3]["text"])
        with pytest.raises(ValueError, match="no EBNF"):
            eng.generate("x", {"ebnf": ARITH})
        with pytest.raises(ValueError, match="'minimum'"):
            eng.generate("x", {"json_schema": json.dumps({"type": "integer", "minimum": 1})})
    finally:
        eng.shutdown()
