"""The grammar backends' own contracts, without a model: matchers (accept, rollback, copy, jump-forward, the
speculative guess), closing plans that complete any prefix, the compile worker, outlines-core and llguidance."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import time

import jsonschema
import pytest
import torch

from conftest import THREADS
from schema_corpus import ARITH, PERSON, REGEXES, SHOP, SQL, SQL_RE, schema_prompt


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


def test_json_objects_never_repeat_a_key(backends, tokenizer):
    """An object open to any key takes each key once (a parser keeps the last of two, so `minProperties` would be
    met by a key written twice): the token that closes a repeated key is refused and cleared from the mask, keys
    spelled with escapes included; the same key in another object is fine; rollback and copy keep the keys."""
    from plait.runtime.constrained.base import token_texts
    from plait.runtime.constrained.bitmask import allocate_bitmask, allowed_bits, clear_bits
    from plait.runtime.constrained.unique_keys import KeyVocab, UniqueKeys

    bitmask = allocate_bitmask(1, 64)
    clear_bits(bitmask, 0, [5, 31, 63])  # bit 31 is an int32's sign
    assert allowed_bits(bitmask[0], torch.arange(64)).logical_not().nonzero().flatten().tolist() == [5, 31, 63]

    vocab = KeyVocab.from_texts(tuple(token_texts(tokenizer, len(tokenizer))))
    schema = {"type": "object", "additionalProperties": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {
        "type": "object", "additionalProperties": {"type": "integer"}}}]}}
    ids = functools.partial(tokenizer.encode, add_special_tokens=False)
    close_key, quote, letter = ids('":')[0], ids('"')[0], ids("b")[0]
    for name in ("xgrammar", "llguidance"):
        compiled = backends[name].compile("json_schema", json.dumps(schema))
        for text, repeats in (('{"a": 1, "b": 2, "a": 3}', True), ('{"a": 1, "b": 2, "\\u0061": 3}', True),
                              ('{"a": [{"a": 1}, {"a": 2, "b": 1}], "b": 2}', False)):
            m = UniqueKeys(compiled.matcher(), vocab)
            taken = [m.accept_token(t) for t in ids(text)]
            assert all(taken) != repeats, (name, text)
        m = UniqueKeys(compiled.matcher(), vocab)
        assert all(m.accept_token(t) for t in ids('{"a": 1, "a'))
        bitmask = allocate_bitmask(1, 49152)
        m.fill_bitmask(bitmask, 0)
        allowed = allowed_bits(bitmask[0], torch.tensor([close_key, quote, letter])).tolist()
        assert allowed == [False, False, True], name  # '"a"' again is refused whichever token closes it
        assert not m.accept_token(close_key) and m.accept_token(letter) and m.accept_token(close_key)  # "ab"
        twin = m.copy()
        m.rollback(2)  # back inside '"a': the key is not written yet
        assert not m.accept_token(close_key) and twin.accept_token(ids(" 1}")[0])


def test_a_comma_into_a_forced_repeated_key_is_refused(tokenizer):
    """A grammar may force a property's name its object already holds (llguidance did, on a schemastore
    schema): the comma that leads there is refused, in the mask and by accept_token, so the object closes
    instead of reaching a key no token may finish."""
    from plait.runtime.constrained.base import token_texts
    from plait.runtime.constrained.bitmask import allocate_bitmask, allow_only, unpack_bitmask
    from plait.runtime.constrained.unique_keys import KeyVocab, UniqueKeys

    ids = functools.partial(tokenizer.encode, add_special_tokens=False)

    class TwoDocuments:  # a grammar of '{"a": 1}' and '{"a": 1, "a": 1}': after the comma it forces ' "a": 1'
        docs = ('{"a": 1}', '{"a": 1, "a": 1}')
        candidates = [ids(t)[0] for t in (",", "}", ' "', "a", '":', " 1")]

        def __init__(self):
            self.taken: list[int] = []

        def _text(self, extra=()):
            return tokenizer.decode(self.taken + list(extra))

        def accept_token(self, t):
            ok = any(d.startswith(self._text([t])) for d in self.docs)
            self.taken += [t] if ok else []
            return ok

        def rollback(self, n):
            del self.taken[len(self.taken) - n:]

        def jump_forward_string(self):
            text = self._text()
            return os.path.commonprefix([d[len(text):] for d in self.docs if d.startswith(text)])

        def fill_bitmask(self, bitmask, row):
            allow_only(bitmask, row, [t for t in self.candidates
                                      if any(d.startswith(self._text([t])) for d in self.docs)])

    vocab = KeyVocab.from_texts(tuple(token_texts(tokenizer, len(tokenizer))))
    m = UniqueKeys(TwoDocuments(), vocab)
    assert all(m.accept_token(t) for t in ids('{"a": 1'))
    bitmask = allocate_bitmask(1, len(tokenizer))
    m.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, len(tokenizer))[0].nonzero().flatten().tolist()
    assert allowed == [ids("}")[0]], [tokenizer.decode([t]) for t in allowed]  # the comma is cleared
    assert not m.accept_token(ids(",")[0]) and m.accept_token(ids("}")[0])


@pytest.mark.parametrize("part", [0] + [pytest.param(k, marks=pytest.mark.slow) for k in range(1, 6)])
def test_closing_plans_complete_any_prefix_for_every_backend(backends, tokenizer, part):
    """From every token boundary of a valid document (a sixth of them by default), the closing search finds a
    completion that
    validates (formats too) and leaves the matcher as it was; a ClosingMatcher over it, driven by a
    writer that picks at random, ends the document within the budget, valid."""
    from plait.runtime.constrained.bitmask import allocate_bitmask, unpack_bitmask
    from plait.runtime.constrained.closing import CloseVocab, ClosingMatcher, plan_close

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
        for k in range(part, len(ids), 6):
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


class MaskCounter:
    """A matcher that counts the masks asked of it (a search's work)."""

    def __init__(self, inner):
        self.inner, self.masks = inner, 0

    def fill_bitmask(self, bitmask, row):
        self.masks += 1
        self.inner.fill_bitmask(bitmask, row)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_closing_leaves_a_run_a_pattern_never_closes_and_writes_required_keys_first(backends, tokenizer):
    """Inside a string whose pattern wants another kind of text ("0000" where `^[0-9]+\\.[0-9]+$` wants a dot, a
    run of digits where a tag wants `:`, of letters where a path wants `/`), the search writes that text instead
    of trying every run of one kind first; and of an object's keys it writes the required ones, not the optional
    ones that come first."""
    from plait.runtime.constrained.closing import CloseVocab, plan_close, required_prefixes

    vocab = CloseVocab.from_tokenizer(tokenizer, 49152, [tokenizer.eos_token_id])
    schema = {"type": "object", "required": ["version", "zone"], "properties": {
        "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+$"},
        "a": {"type": "string"}, "b": {"type": "string"}, "c": {"type": "string"}, "zone": {"type": "string"},
        "tag": {"type": "string", "pattern": "^#[a-z0-9_.-]+:[a-z0-9_.-]+"},
        "path": {"type": "string", "pattern": "^[^/]+/[^/]+$"}}}
    check = jsonschema.Draft202012Validator(schema)
    for name in ("llguidance",):  # the backend that takes this pattern exactly (auto's choice for it)
        g = backends[name].compile("json_schema", json.dumps(schema))
        for prefix in ('{"version": "000', '{"version": "1.0", ',
                       '{"version": "1.0", "zone": "", "tag": "#9' + "2" * 40,
                       '{"version": "1.0", "zone": "", "path": "abc' + "d" * 30):
            m = MaskCounter(g.matcher())
            assert all(m.accept_token(i) for i in tokenizer.encode(prefix, add_special_tokens=False))
            plan = plan_close(m, vocab, prefix, 48, required_prefixes(json.dumps(schema)))
            # found, and early: a search that tried every run of one kind first spent all its MAX_MASKS
            assert plan is not None and m.masks < 300, (name, prefix, m.masks)
            closed = json.loads(prefix + tokenizer.decode(plan))
            assert check.is_valid(closed) and set(closed) - {"tag", "path"} == {"version", "zone"}, (name, closed)


def test_compile_worker_kills_a_runaway_compile_and_rebuilds_what_it_compiled(tokenizer):
    """Scheduler compiles run in a worker process, without torch: each backend's grammar comes back as the one
    compiled here (the same mask). Under auto, a backend whose compile outlives its share of the timeout (its
    worker is killed) or whose worker dies is one more refusal: the next backend compiles it."""
    from plait.runtime.constrained import GrammarCache, create_backend
    from plait.runtime.constrained.compile_worker import IsolatedCompiler, WorkerConfig
    from plait.runtime.model_loader.tokenizer import grammar_vocab
    from plait.runtime.server_args import default_model_path

    config = WorkerConfig("auto", default_model_path())
    _, vocab_size, eos_ids = grammar_vocab(default_model_path())  # what the worker builds its backend with
    assert vocab_size == 49152 and tokenizer.eos_token_id in eos_ids
    backend = create_backend("auto", tokenizer, vocab_size, eos_ids)
    cache = GrammarCache(backend, 16, workers=1, new_compiler=lambda: IsolatedCompiler(backend, config, 8.0))
    compiler = cache._compilers[0]
    try:
        compiler.wait_ready()  # started on the first compile otherwise
        assert compiler.worker._ready
        with open(f"/proc/{compiler.worker._proc.pid}/maps") as maps:  # a worker only compiles: torch stays out of its memory
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
