"""The real scheduler over a scripted model (tests/scripted.py): admission, chunked prefill, retraction, the radix
cache, stop conditions, aborts, logprobs and faults, each checked against greedy decoding of the same script on the
true sequence, and the KV accounting after every run. What only a real model shows stays in the model-backed tests."""

from __future__ import annotations

import json
import math
import random
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from scripted import LEAD, default_vocab, drain, hashed, msg, reference, scheduler, varied

from plait.runtime.forward.batch import ForwardMode
from plait.runtime.ipc.messages import GRAMMAR_CLOSED, AbortReq

SCRIPT = hashed()


def prompts(n: int, length: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    """n prompts of `length` tokens, the first `shared` of them common to all."""
    rng = random.Random(seed)
    head = [rng.randrange(2000, 3000) for _ in range(shared)]
    return [head + [rng.randrange(2000, 3000) for _ in range(length - shared)] for _ in range(n)]


def run_all(sched, outs, ps: list[list[int]], max_new: int = 16, **params) -> dict[str, dict]:
    for i, p in enumerate(ps):
        sched.add_request(msg(f"r{i}", p, max_new_tokens=max_new, **params))
    return drain(sched, outs)


def assert_reference(results: dict[str, dict], ps: list[list[int]], max_new: int, script=SCRIPT) -> None:
    for i, p in enumerate(ps):
        assert results[f"r{i}"]["ids"] == reference(script, p, max_new), f"r{i}"


def test_a_batch_decodes_as_each_request_alone():
    sched, outs = scheduler(SCRIPT)
    ps = [p[: 3 + 5 * i] for i, p in enumerate(prompts(12, 60, seed=1))]
    results = run_all(sched, outs, ps, max_new=24)
    assert_reference(results, ps, 24)
    assert all(r["finish"].type == "length" for r in results.values())
    assert max(sum(it.mode is ForwardMode.DECODE for it in f) for f in sched.runner.forwards) > 1  # batched
    assert sched.kv.check() is None


def test_a_shared_prefix_is_computed_once():
    sched, outs = scheduler(SCRIPT)
    first, second = prompts(2, 80, seed=2, shared=64)
    assert_reference(run_all(sched, outs, [first]), [first], 16)
    sched.runner.forwards.clear()
    sched.add_request(msg("r0", second))
    results = drain(sched, outs)
    assert results["r0"]["ids"] == reference(SCRIPT, second, 16)
    assert results["r0"]["last"].cached_tokens == 64
    prefill = sched.runner.forwards[0][0]
    assert prefill.cached_len == 64 and len(prefill.tokens) == 16  # only the new tail was computed
    assert sched.kv.check() is None


def test_a_sibling_waits_a_step_to_share_a_prefix_computed_beside_it():
    sched, outs = scheduler(SCRIPT)
    ps = prompts(2, 100, seed=3, shared=90)
    results = run_all(sched, outs, ps)
    assert_reference(results, ps, 16)
    assert results["r1"]["last"].cached_tokens == 90
    assert sched.kv.check() is None


@pytest.mark.parametrize("chunk", [7, 32])
def test_chunked_prefill_runs_beside_decodes(chunk):
    sched, outs = scheduler(SCRIPT, chunked_prefill_size=chunk)
    ps = prompts(4, 100, seed=4)
    ps[0] = ps[0][:5]  # decodes while the others prefill
    results = run_all(sched, outs, ps, max_new=20)
    assert_reference(results, ps, 20)
    prefill_sizes = [len(it.tokens) for f in sched.runner.forwards for it in f if it.mode is ForwardMode.EXTEND]
    assert max(prefill_sizes) <= chunk
    assert any({it.mode for it in f} == {ForwardMode.EXTEND, ForwardMode.DECODE} for f in sched.runner.forwards)
    assert sched.kv.check() is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_a_tiny_pool_keeps_outputs_and_slots(page_size):
    sched, outs = scheduler(SCRIPT, num_slots=300, page_size=page_size)
    ps = prompts(8, 30, seed=5, shared=10)
    results = run_all(sched, outs, ps, max_new=60)
    assert_reference(results, ps, 60)
    assert sched.admission.num_retracted > 0
    assert sum(r["last"].num_retractions for r in results.values()) == sched.admission.num_retracted
    assert sched.kv.check() is None


def test_a_request_larger_than_the_pool_is_refused_and_one_that_outgrows_it_is_cut():
    sched, outs = scheduler(SCRIPT, num_slots=64)
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        sched.add_request(msg("big", list(range(2000, 2070))))
    sched.add_request(msg("grows", list(range(2000, 2050)), max_new_tokens=100))
    r = drain(sched, outs)["grows"]
    assert r["finish"].type == "length" and r["finish"].message == "KV cache is full"
    assert r["ids"] == reference(SCRIPT, list(range(2000, 2050)), len(r["ids"]))
    assert sched.kv.check() is None


def test_max_running_requests_bounds_a_forward():
    sched, outs = scheduler(SCRIPT, max_running_requests=3)
    ps = prompts(7, 20, seed=6)
    results = run_all(sched, outs, ps)
    assert_reference(results, ps, 16)
    assert max(len(f) for f in sched.runner.forwards) <= 3
    assert sched.kv.check() is None


def test_stop_conditions():
    tok, _, eos = default_vocab()
    stop_word = tok.encode(" finished", add_special_tokens=False)
    plan = [1500, 1501] + stop_word + [1502] * 4 + [eos[0]] + [1503] * 8

    def script(ctx):  # writes `plan` after the prompt (the prompt is 5 tokens)
        return plan[min(len(ctx) - 5, len(plan) - 1)]

    sched, outs = scheduler(script)
    prompt = [2000, 2001, 2002, 2003, 2004]
    cases = {
        "eos": dict(),
        "ignore_eos": dict(ignore_eos=True, max_new_tokens=12),
        "min_new": dict(min_new_tokens=len(plan) - 7),
        "stop_id": dict(stop_token_ids=[1501]),
        "stop_str": dict(stop=["finished"]),
    }
    for rid, params in cases.items():
        sched.add_request(msg(rid, prompt, **{"max_new_tokens": 30, **params}))
    results = drain(sched, outs)
    at_eos = plan.index(eos[0]) + 1
    assert results["eos"]["ids"] == plan[:at_eos] and results["eos"]["finish"].matched == eos[0]
    assert results["ignore_eos"]["ids"] == plan[:12] and results["ignore_eos"]["finish"].type == "length"
    assert results["min_new"]["finish"].type == "length" and len(results["min_new"]["ids"]) == 30
    assert results["stop_id"]["ids"] == plan[:2] and results["stop_id"]["finish"].matched == 1501
    stopped = results["stop_str"]
    assert stopped["finish"].matched == "finished" and stopped["ids"] == plan[: 2 + len(stop_word)]
    assert sched.kv.check() is None


def test_an_abort_ends_one_request_and_returns_its_kv():
    sched, outs = scheduler(SCRIPT)
    ps = prompts(4, 20, seed=7)
    for i, p in enumerate(ps):
        sched.add_request(msg(f"r{i}", p, max_new_tokens=40))
    sched.add_request(msg("queued", ps[0] + [5], max_new_tokens=40))

    def abort_some(s, step):
        if step == 5:
            s.abort(AbortReq("r1"))
            s.abort(AbortReq("queued"))

    results = drain(sched, outs, between=abort_some)
    assert results["r1"]["finish"].type == "abort" and len(results["r1"]["ids"]) < 40
    assert results["queued"]["finish"].type == "abort"
    for i in (0, 2, 3):
        assert results[f"r{i}"]["ids"] == reference(SCRIPT, ps[i], 40)
    assert sched.kv.check() is None


def test_logprobs_of_prompt_and_output_across_chunks():
    sched, outs = scheduler(SCRIPT, chunked_prefill_size=8)
    p = prompts(1, 30, seed=8)[0]
    sched.add_request(msg("r0", p, max_new_tokens=6, return_logprob=True, logprob_start_len=0, top_logprobs_num=2))
    r = drain(sched, outs)["r0"]
    out_lp, in_lp, top = r["logprobs"], r["input_logprobs"], r["top"]
    vocab = sched.runner.config.vocab_size
    hit = LEAD - math.log(math.exp(LEAD) + vocab - 1)  # the scripted token's logprob
    miss = -math.log(math.exp(LEAD) + vocab - 1)
    ids = reference(SCRIPT, p, 6)
    assert r["ids"] == ids and all(lp == pytest.approx(hit, abs=1e-4) for lp in out_lp) and len(out_lp) == 6
    assert [t for _, t in in_lp] == p and in_lp[0][0] is None
    for k, (lp, t) in enumerate(in_lp[1:], start=1):  # the prompt scored by the script's choice at each position
        assert lp == pytest.approx(hit if SCRIPT(tuple(p[:k])) == t else miss, abs=1e-4)
    assert all(len(t) == 2 and t[0][1] == i for t, i in zip(top, ids))
    assert sched.kv.check() is None


def test_a_runner_fault_reaches_the_loop():
    """A forward that raises is a fault of the process, not of one request: it reaches the loop (which fails the
    server loudly), never a silent hang."""
    sched, outs = scheduler(SCRIPT)
    sched.add_request(msg("r0", [2000, 2001, 2002]))
    sched.runner.fail_next = RuntimeError("forward failed")
    with pytest.raises(RuntimeError, match="forward failed"):
        sched.step()


@pytest.mark.parametrize("seed", range(3))
def test_seeded_sampling_is_the_same_alone_and_in_a_batch(seed):
    def soft(ctx):  # a flat-ish distribution over 50 tokens, so sampling varies
        g = torch.Generator().manual_seed(hash(ctx[-2:]) & 0xFFFF)
        logits = torch.full((default_vocab()[1],), -1e4)
        logits[1000:1050] = torch.rand(50, generator=g) * 2
        return logits

    ps = prompts(4, 12, seed=seed)
    params = dict(temperature=0.8, seed=seed)
    sched, outs = scheduler(soft)
    alone = {}
    for i, p in enumerate(ps):
        sched.add_request(msg("x", p, max_new_tokens=12, **params))
        alone[i] = drain(sched, outs)["x"]["ids"]
    together = run_all(sched, outs, ps, max_new=12, **params)
    assert all(together[f"r{i}"]["ids"] == alone[i] for i in range(4))
    assert len({tuple(v) for v in alone.values()}) > 1


def repetitive(ctx: tuple[int, ...]) -> int:
    """Mostly a cycle of 7 tokens (n-gram drafts find it), breaking it at every 11th position (drafts rejected)."""
    n = len(ctx)
    return 1400 + n % 13 if n % 11 == 0 else 1000 + n % 7


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX"])
@pytest.mark.parametrize("policy", ["fixed", "measured"])
def test_drafts_keep_the_greedy_output_and_their_kv(algorithm, policy):
    sched, outs = scheduler(repetitive, speculative_algorithm=algorithm, speculative_draft_policy=policy,
                            speculative_num_draft_tokens=6, num_slots=600)
    ps = prompts(6, 12, seed=9)
    results = run_all(sched, outs, ps, max_new=70)
    assert_reference(results, ps, 70, repetitive)
    drafted = sum(r["last"].spec_drafted for r in results.values())
    accepted = sum(r["last"].spec_accepted for r in results.values())
    if policy == "fixed":  # the measured policy drafts by this machine's timings: what it drafts varies
        assert drafted > accepted > 0, (drafted, accepted)  # some drafts kept, some rejected
    assert sched.kv.check() is None


def test_drafts_under_retraction_keep_outputs_and_slots():
    sched, outs = scheduler(repetitive, speculative_algorithm="NGRAM", speculative_draft_policy="fixed",
                            num_slots=200)
    ps = prompts(6, 16, seed=10, shared=8)
    results = run_all(sched, outs, ps, max_new=50)
    assert_reference(results, ps, 50, repetitive)
    assert sched.admission.num_retracted > 0
    assert sched.kv.check() is None


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive, are aborted and run under random pools, chunk sizes, caches and drafters; after every
    step each KV slot is free, cached or owned by exactly one running request, and every request that was not
    aborted ends with the script's greedy output (cut short only where the pool could not hold it)."""

    @initialize(slots=st.integers(48, 400), chunk=st.sampled_from([-1, 8, 32]), cache=st.booleans(),
                drafts=st.sampled_from([None, "NGRAM", "SUFFIX"]), running=st.sampled_from([2, 4, 16]),
                page=st.sampled_from([1, 4]))
    def start(self, slots, chunk, cache, drafts, running, page):
        self.sched, self.outs = scheduler(repetitive, num_slots=slots, chunked_prefill_size=chunk, page_size=page,
                                          disable_radix_cache=not cache, speculative_algorithm=drafts,
                                          speculative_draft_policy="fixed", max_running_requests=running)
        self.prompts: dict[str, list[int]] = {}
        self.max_new: dict[str, int] = {}
        self.aborted: set[str] = set()

    @rule(stem=st.sampled_from([(), (2000, 2001, 2002, 2003), tuple(range(2100, 2130))]),
          tail=st.lists(st.integers(2000, 2010), min_size=1, max_size=20), max_new=st.integers(8, 60))
    def add(self, stem, tail, max_new):
        rid, prompt = f"r{len(self.prompts)}", list(stem) + tail
        if len(prompt) + 1 > self.sched.runner.allocator.capacity:
            with pytest.raises(ValueError, match="does not fit the KV pool"):
                self.sched.add_request(msg(rid, prompt, max_new_tokens=max_new))
            return
        self.prompts[rid], self.max_new[rid] = prompt, max_new
        self.sched.add_request(msg(rid, prompt, max_new_tokens=max_new))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.prompts)))
        self.aborted.add(rid)
        self.sched.abort(AbortReq(rid))

    @rule(n=st.integers(1, 8))
    def step(self, n):
        for _ in range(n):
            self.sched.step()
            assert self.sched.kv.check(self.sched.running) is None, self.sched.kv.check(self.sched.running)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        results = drain(self.sched, self.outs)
        assert self.sched.kv.check() is None, self.sched.kv.check()
        for rid, prompt in self.prompts.items():
            if rid in self.aborted:
                continue
            r = results[rid]
            want = reference(repetitive, prompt, self.max_new[rid])
            if r["finish"].message in ("KV cache is full", "request does not fit the KV cache"):
                assert r["ids"] == want[: len(r["ids"])]
            else:
                assert r["ids"] == want, rid


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None, derandomize=True,
                                         suppress_health_check=list(HealthCheck))


# ---- constrained decoding ------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"identifier_of_the_record": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["identifier_of_the_record", "tags"], "additionalProperties": False}


def stubborn(wanted: str):
    """A model that always wants `wanted`'s first token, and otherwise prefers low ids a little."""
    tok, vocab, _ = default_vocab()
    want = tok.encode(wanted, add_special_tokens=False)[0]
    row = -torch.arange(vocab, dtype=torch.float32) / vocab
    row[want] = LEAD

    def script(ctx):
        return row
    return script


@pytest.fixture(scope="module")
def grammar_sched():
    """One scheduler for the grammar tests: its compile worker starts once."""
    sched, outs = scheduler(stubborn("7"))
    yield sched, outs
    sched.close()


def _grammar_results(sched, outs, reqs):
    for m in reqs:
        sched.add_request(m)
    return drain(sched, outs, timeout=120)


@pytest.mark.parametrize("masked", ["lazily", "up front"])
def test_a_grammar_overrules_the_model(grammar_sched, masked):
    """Greedy picks are checked after sampling (the mask filled on rejection); top-k masks before sampling."""
    sched, outs = grammar_sched
    extra = {} if masked == "lazily" else {"top_k": 5}
    results = _grammar_results(sched, outs, [msg("re", [2000, 2001], regex="[a-z]{3,8}", max_new_tokens=12, **extra),
                                             msg("free", [2000, 2001], max_new_tokens=3)])
    tok = default_vocab()[0]
    text = tok.decode(results["re"]["ids"], skip_special_tokens=True)
    assert re.fullmatch("[a-z]{3,8}", text), text
    assert results["free"]["ids"] == [tok.encode("7", add_special_tokens=False)[0]] * 3  # the model's own pick
    assert sched.kv.check() is None


def test_a_schema_jumps_forward_and_closes_before_the_budget(grammar_sched):
    sched, outs = grammar_sched
    jumped = sched.speculation.stats()["tokens_jumped"]
    results = _grammar_results(sched, outs, [
        msg("whole", [2000], json_schema=json.dumps(SCHEMA), max_new_tokens=200),
        msg("cut", [2000], json_schema=json.dumps(SCHEMA), max_new_tokens=40)])
    tok = default_vocab()[0]
    for rid in ("whole", "cut"):
        value = json.loads(tok.decode(results[rid]["ids"], skip_special_tokens=True))
        jsonschema.validate(value, SCHEMA)
        assert len(results[rid]["ids"]) <= {"whole": 200, "cut": 40}[rid]
    assert results["cut"]["finish"].message == GRAMMAR_CLOSED  # the model would have written on
    assert sched.speculation.stats()["tokens_jumped"] > jumped  # the key names were forced text
    assert any(it.mode is ForwardMode.TARGET_VERIFY for f in sched.runner.forwards for it in f)
    assert sched.kv.check() is None


def test_a_bad_grammar_fails_its_request_alone(grammar_sched):
    sched, outs = grammar_sched
    results = _grammar_results(sched, outs, [msg("bad", [2000], regex="[a-"), msg("ok", [2000], max_new_tokens=2)])
    assert results["bad"]["finish"].type == "abort" and results["bad"]["finish"].status == 400
    assert len(results["ok"]["ids"]) == 2
    assert sched.kv.check() is None


def unsure(ctx: tuple[int, ...]) -> torch.Tensor:
    """repetitive()'s token most of the time, and a few others now and then: sampled drafts are kept and rejected."""
    logits = torch.full((default_vocab()[1],), -30.0)
    logits[1600:1604] = 0.0
    logits[repetitive(ctx)] = 4.0
    return logits


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX"])
def test_drafts_change_no_seeded_sample_stop_or_logprob(algorithm):
    """One draw per emitted token from the request's own generator, stops inside a kept draft ending the output
    where they would without drafts, and the same logprobs per token."""
    ps = prompts(4, 14, seed=11)
    cases = [dict(temperature=0.9, seed=5 + i, max_new_tokens=60) for i in range(4)]
    cases += [dict(stop_token_ids=[1003], max_new_tokens=60), dict(max_new_tokens=23),
              dict(return_logprob=True, top_logprobs_num=2, max_new_tokens=30)]

    def outputs(**flags):
        sched, outs = scheduler(unsure, **flags)
        for i, params in enumerate(cases):
            sched.add_request(msg(f"r{i}", ps[i % 4], **params))
        results = drain(sched, outs)
        assert sched.kv.check() is None
        return sched, results

    _, plain = outputs()
    sched, drafted = outputs(speculative_algorithm=algorithm, speculative_draft_policy="fixed")
    for rid, r in plain.items():
        got = drafted[rid]
        assert got["ids"] == r["ids"] and got["finish"] == r["finish"], rid
        assert got["logprobs"] == pytest.approx(r["logprobs"], abs=1e-5) and len(got["top"]) == len(r["top"])
    assert plain["r4"]["finish"].matched == 1003 and len(plain["r5"]["ids"]) == 23
    assert len(plain["r6"]["logprobs"]) == 30
    assert drafted["r6"]["last"].spec_accepted > 0 and sched.speculation.stats()["spec_accepted_tokens"] > 0


def test_jump_forward_changes_no_token_and_saves_forwards():
    person = {"type": "object", "properties": {"full_name": {"type": "string", "maxLength": 12},
                                               "year_of_birth": {"type": "integer"}, "alive": {"type": "boolean"}},
              "required": ["full_name", "year_of_birth", "alive"], "additionalProperties": False}

    def run(**flags):
        sched, outs = scheduler(varied, **flags)
        results = {}
        for i in range(3):  # one at a time: forwards count tokens, not batching
            sched.add_request(msg(f"r{i}", [2000 + i], json_schema=json.dumps(person), max_new_tokens=80))
            results.update(drain(sched, outs, timeout=120))
        sched.close()
        return results, len(sched.runner.forwards)

    jumped, passes_jf = run()
    plain, passes = run(disable_jump_forward=True)
    tok = default_vocab()[0]
    for rid, r in plain.items():
        assert jumped[rid]["ids"] == r["ids"], rid
        jsonschema.validate(json.loads(tok.decode(r["ids"], skip_special_tokens=True)), person)
    assert passes_jf < 0.85 * passes, (passes_jf, passes)


def test_suffix_drafts_an_answer_given_before_from_the_shared_store():
    sched, outs = scheduler(SCRIPT, speculative_algorithm="SUFFIX", speculative_draft_policy="fixed")
    p = prompts(1, 20, seed=12)[0]
    first = run_all(sched, outs, [p], max_new=48)
    shared = sched.speculation.stats()["spec_suffix"]["drafts_shared"]
    again = run_all(sched, outs, [p], max_new=48)
    assert again["r0"]["ids"] == first["r0"]["ids"] == reference(SCRIPT, p, 48)
    assert sched.speculation.stats()["spec_suffix"]["drafts_shared"] > shared
    last = again["r0"]["last"]
    assert last.spec_accepted > 0.8 * last.spec_drafted and 1 + last.spec_accepted / last.spec_verify_ct > 3


def _embed(rid: str, prompt: list[int], pooling: str) -> "TokenizedGenerateReq":
    from plait.runtime.ipc.messages import EmbedSpec, TokenizedGenerateReq
    from plait.runtime.sampling import SamplingParams

    return TokenizedGenerateReq(rid, list(prompt), SamplingParams(max_new_tokens=0), embed=EmbedSpec(pooling))


def test_embeddings_pool_chunked_prompts_and_read_only_what_they_may_from_the_cache():
    """The scripted final state of a token is (id, position, 1): mean pooling over a prompt computed in 16-token
    chunks is the mean over all its tokens, last and CLS pooling its last and first token's; they run beside a
    decoding request. Again on the same prompt: last-token pooling takes its prefix from the cache, mean pooling
    computes everything."""
    sched, outs = scheduler(SCRIPT, chunked_prefill_size=16)
    p = prompts(1, 50, seed=9)[0]
    want = {"mean": [sum(p) / 50, 24.5, 1.0], "last": [p[-1], 49.0, 1.0], "cls": [p[0], 0.0, 1.0]}
    sched.add_request(msg("gen", p[:20], max_new_tokens=8))
    for pooling in want:
        sched.add_request(_embed(pooling, p, pooling))
    results = drain(sched, outs)
    assert results["gen"]["ids"] == reference(SCRIPT, p[:20], 8)
    for k in want:
        assert results[k]["last"].embedding == pytest.approx(want[k])
        assert results[k]["ids"] == [] and results[k]["finish"].type == "stop"
    assert results["gen"]["last"].embedding is None
    for pooling in ("mean", "last"):
        sched.add_request(_embed(f"{pooling}2", p, pooling))
    again = {k: r["last"] for k, r in drain(sched, outs).items()}
    assert again["last2"].embedding == pytest.approx(want["last"]) and again["last2"].cached_tokens == 49
    assert again["mean2"].embedding == pytest.approx(want["mean"]) and again["mean2"].cached_tokens == 0
    assert sched.kv.check() is None
