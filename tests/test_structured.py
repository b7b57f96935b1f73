"""Structured output on the real model: JSON schemas from real projects (validated with
jsonschema, formats included), regexes, EBNF grammars, jump-forward equivalence, errors, outputs closed
before max_new_tokens. The policy and the backends without a model: test_schema_policy.py,
test_grammar_backends.py."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from conftest import THREADS
from schema_corpus import ARITH, PERSON, REGEXES, SHOP, SQL, SQL_RE, corpus, schema_prompt, validator


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
    """Every 60th schema of the corpus by default; every one in `make test-slow`."""
    rows = corpus(every=60)
    compiled, rejected, checked = _generate_corpus(engine, tokenizer, rows, max_new=192)
    assert len(compiled) >= 4 and checked >= 4  # 4 of these 5 compile; an output may ramble in a string to max_new_tokens
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


@pytest.mark.slow  # the scheduler's part runs by default in test_scheduler.py, over a scripted model
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


