"""Speculative decoding: NGRAM, SUFFIX and EAGLE-3 drafts, verified so that they never change the output."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import THREADS, chat_prompt

TEXTS = [
    "The committee met on Tuesday to review the budget. It approved funding for the new library, "
    "postponed the decision on the park, and asked the city manager for a report on road repairs.",
    "def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n",
    "Alice bought three apples, two pears and a melon. Bob bought two apples and a melon. "
    "Carol bought nothing but asked for the price of the melon.",
    '{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for": "the first program"}',
]
TASKS = ["Repeat this text exactly:\n{}", "Summarize in one sentence:\n{}", "Rewrite this with every name in "
         "capitals:\n{}", "Quote the first line of this, then explain it:\n{}"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                            "born": {"type": "integer"}, "field": {"type": "string", "maxLength": 30}},
          "required": ["name", "born", "field"], "additionalProperties": False}


def prompts(tokenizer, n: int) -> list[str]:
    cases = [task.format(text) for task in TASKS for text in TEXTS]
    return [chat_prompt(tokenizer, c) for c in (cases * (1 + n // len(cases)))[:n]]


# ---- NGRAM lookup ----------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_latest_match():
    from plait.runtime.speculative.ngram import NgramIndex

    ix = NgramIndex(1, 3)
    assert ix.propose([5], 4) == []  # nothing before it
    seq = [1, 2, 3, 9, 1, 2, 4, 8, 2, 3]
    # the suffix [2, 3] occurred at 1..2 (followed by 9, 1, 2); [3] alone would say the same here
    assert ix.propose(seq, 3) == [9, 1, 2]
    seq += [7, 1, 2]
    # [1, 2] occurred twice: the latest (at 4..5, followed by 4, 8) wins over the first
    assert ix.propose(seq, 2) == [4, 8]
    seq += [4, 8, 2, 3, 7]
    # the longest suffix first: [2, 3, 7] (followed by 1, 2, 4) beats [3, 7] and [7]
    assert ix.propose(seq, 3) == [1, 2, 4]
    assert ix.propose(seq + [6], 3) == []  # 6 never occurred
    assert ix.propose(seq, 0) == []
    # forced text not yet verified (after `settled` tokens) takes part in the lookup but is never indexed
    ix = NgramIndex(1, 2)
    assert ix.propose([1, 2, 3, 4, 5, 2, 3], 2, settled=5) == [4, 5]
    # the model wrote 7 where [2, 3] was drafted: [2] is looked up where it really occurred, not in the rejected tail
    assert ix.propose([1, 2, 3, 4, 5, 7, 2], 2, settled=7) == [3, 4]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramIndex(3, 2)


# ---- SUFFIX lookup ---------------------------------------------------------------------------
def test_suffix_index_finds_the_longest_match_and_its_continuations():
    from plait.runtime.speculative.suffix import SuffixIndex

    ix = SuffixIndex()
    ix.extend(0, [1, 2, 3, 4, 9, 2, 3, 5])
    ix.extend(1, [7, 2, 3, 4, 6])
    # [2, 3] ends at 3 (then 4) and 7 (then 5) in sequence 0, and at 3 (then 4) in 1; [1, 2, 3] is longest
    assert ix.matches([8, 1, 2, 3], 8) == (3, [(0, 3)])
    length, found = ix.matches([0, 2, 3], 8)  # only the pair matches: every occurrence with a continuation
    assert length == 2 and sorted(found) == [(0, 3), (0, 7), (1, 3)]
    assert ix.matches([2, 3, 5], 8) == (0, [])  # [3, 5] ends sequence 0: nothing followed it yet
    assert ix.matches([9, 9], 8) == (0, [])
    length, found = ix.matches([7, 2, 3], 2)  # the depth caps the match: [7, 2, 3] no longer beats [2, 3]
    assert length == 2 and len(found) == 3
    ix.extend(0, [6])  # a sequence grows: the pair it ends is indexed, its old end now has a continuation
    assert ix.matches([3, 5], 8) == (2, [(0, 8)])
    ix.remove(0)
    assert ix.matches([1, 2, 3], 8) == (2, [(1, 3)]) and ix.tokens == 5


def test_suffix_drafts_follow_frequencies():
    from plait.runtime.speculative.suffix import draft_from

    conts = [[5, 6, 7], [5, 6, 8], [5, 6, 7], [9]]
    chain, score = draft_from(conts, 3, 0.1, tree=False)
    # 5 follows 3 of 4 occurrences, 6 all three of those, 7 two of them: 0.75, 0.75, 0.5
    assert chain.tokens == [5, 6, 7] and chain.parents is None and math.isclose(score, 2.0)
    assert draft_from(conts, 3, 0.6, tree=False)[0].tokens == [5, 6]  # 0.5 is below the floor
    tree, score = draft_from(conts, 4, 0.1, tree=True)
    assert tree.tokens == [5, 6, 7, 9] and tree.parents == [-1, 0, 1, -1]  # the likeliest nodes, parents first
    assert math.isclose(score, 0.75 + 0.75 + 0.5 + 0.25)
    assert draft_from([], 3, 0.1, tree=False)[0].tokens == []


# ---- verification keeps the model's distribution -------------------------------------------
def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_verification_samples_the_models_distribution(shape):
    """A draft is kept where the sampler, drawing as it would one step at a time, picks the draft's token
    (in a tree: the walk goes on into the child holding the pick): over many seeds, each emitted position
    follows the target's softmax given the tokens before it (chi-square, tiny vocabulary)."""
    from plait.runtime.sampling.params import SamplingParams
    from plait.runtime.speculative.verify import sampler_picks, walk

    vocab, temp = 5, 0.8
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 0.3, 0.9], [1.0, 1.0, 1.0, 0.0, 0.0],
                         [0.3, 0.0, 1.2, 0.7, 0.1]])
    # neither is the likeliest token: both keeping and rejecting are common. The tree adds a second child
    # of the root (token 2) whose own row is rows[3]
    draft, parents = ([1, 4], None) if shape == "chain" else ([1, 4, 2], [-1, 0, -1])
    params = SamplingParams(temperature=temp, max_new_tokens=16)
    first, second = [0] * vocab, {1: [0] * vocab, 2: [0] * vocab}
    trials = 6000
    for seed in range(trials):
        req = SimpleNamespace(draft=SimpleNamespace(tokens=draft), params=params, output_ids=[7, 7],
                              generator=torch.Generator().manual_seed(seed), origin_input_ids=[3],
                              return_logprob=False, top_logprobs_num=0)
        path, tok = walk(draft, parents, sampler_picks(req, rows[: len(draft) + 1], set(), []))
        emitted = [draft[i] for i in path] + [tok]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[0]][emitted[1]] += 1
    checks = [(first, rows[0]), (second[1], rows[1])] + ([(second[2], rows[3])] if shape == "tree" else [])
    for counts, row in checks:
        probs = torch.softmax(row / temp, -1).tolist()
        # 4 degrees of freedom: p < 0.001 beyond 18.47
        assert _chi_square(counts, probs) < 18.47, (counts, [round(p * sum(counts)) for p in probs])
    assert 0.1 < second[1][4] / sum(second[1]) < 0.5 and sum(second[1]) > 1000  # the second draft token was tested
    if shape == "tree":
        assert sum(second[2]) > 500


# ---- the real model --------------------------------------------------------------------------
# EAGLE3: the head shipped for the default model, drafting chains sized by the measured policy (the default);
# EAGLE3-tree: trees of top-4 expansions. NGRAM and the trees draft their most every step (the fixed policy), so
# what they keep depends on the drafts alone, not on this machine's timings. The trees run in the slow target
# (`make test-slow`; the tree mask itself is checked at the logits level in test_eagle.py, and the tree walk's
# distribution above). The scheduler's side of every drafter (the walk, the KV of rejected drafts, stops, seeds and
# logprobs inside kept drafts) runs by default in test_scheduler.py over a scripted model; here by default only
# EAGLE-3's output identity (test_drafted_outputs_are_token_identical), the rest in the slow target
ALGORITHMS = [pytest.param(name, marks=pytest.mark.slow) for name in ("NGRAM", "SUFFIX", "EAGLE3", "STANDALONE",
                                                                     "EAGLE3-tree")]
_FLAGS = {"NGRAM": {"speculative_algorithm": "NGRAM", "speculative_draft_policy": "fixed"},
          "SUFFIX": {"speculative_algorithm": "SUFFIX", "speculative_draft_policy": "fixed"},
          "EAGLE3": {"speculative_algorithm": "EAGLE3"},
          # the target as its own draft model, its whole vocabulary: under batch-invariant kernels its picks are the
    # target's own
          "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_draft_policy": "fixed",
                         "speculative_draft_vocab_size": 0},
          "EAGLE3-tree": {"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 4,
                          "speculative_draft_policy": "fixed"}}


@pytest.fixture(scope="module")
def deterministic():
    """The deterministic engine without drafts, and with each algorithm's drafts (batch-invariant kernels: a
    row's logits do not depend on what shares its forward, so verified rows equal decoded ones bit for bit),
    each started when a test first asks for it."""
    from plait import Engine
    from plait.runtime.server_args import default_model_path

    common = dict(num_threads=THREADS, max_total_tokens=16384, dtype="float32", log_level="warning",
                  enable_deterministic_inference=True)
    engines: dict = {}

    def get(algorithm: str | None):
        if algorithm not in engines:
            flags = dict(_FLAGS.get(algorithm, {}))
            if algorithm == "STANDALONE":
                flags["speculative_draft_model_path"] = default_model_path()
            engines[algorithm] = Engine(**common, **flags)
        return engines[algorithm]

    yield get
    for e in engines.values():
        e.shutdown()


@pytest.fixture(params=ALGORITHMS)
def engines(request, deterministic):
    return deterministic(None), deterministic(request.param)


def _run(engine, texts, params, batch: int) -> list[dict]:
    outs = []
    for i in range(0, len(texts), batch):
        outs += engine.generate(texts[i : i + batch], params if isinstance(params, dict) else params[i : i + batch])
    return outs


def _cases(batch: int, n: int, default: tuple[str, ...]) -> list:
    """(algorithm, batch, n) for each algorithm: in the default run for `default`, else in `make test-slow`."""
    names = [a if isinstance(a, str) else a.values[0] for a in ALGORITHMS]
    return [pytest.param(a, batch, n, marks=() if a in default else pytest.mark.slow) for a in names]


# by default EAGLE-3 (one stream and batches: its head keeps K/V at the target's slots); the lookups, a draft model
# and every drafter's longer sets in `make test-slow`
@pytest.mark.parametrize("engines,batch,n", _cases(1, 6, ("EAGLE3",))
                         + _cases(8, 16, ("EAGLE3",)) + _cases(1, 32, ()) + _cases(8, 32, ()),
                         indirect=["engines"])
def test_drafted_outputs_are_token_identical(engines, batch, n):
    plain, spec = engines
    texts = prompts(plain.tokenizer, n)
    params = {"temperature": 0, "max_new_tokens": 48}
    before = spec.get_server_info()
    ref, got = _run(plain, texts, params, batch), _run(spec, texts, params, batch)
    for r, g in zip(ref, got):
        assert g["output_ids"] == r["output_ids"], (r["text"], g["text"])
    info = spec.get_server_info()
    kept = info["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert info["spec_verifies"] > before["spec_verifies"] and kept > 0
    if spec.args.speculative_draft_policy == "fixed" and batch == 1:  # what is kept depends on the drafts alone
        assert kept > 0.1 * sum(len(g["output_ids"]) for g in got)
        # NGRAM copies long runs of these repeat-and-rewrite tasks; the small EAGLE-3 head keeps less per verify
        longest = max(g["meta_info"].get("spec_accept_length", 0) for g in got)
        assert longest > (2 if spec.args.speculative_algorithm == "NGRAM" else 1.4), longest
        if spec.args.speculative_algorithm == "STANDALONE":  # the target drafting for itself: every draft is kept
            drafted = info["spec_draft_tokens"] - before["spec_draft_tokens"]
            assert kept == drafted, (kept, drafted)
    # fewer forwards than tokens: the kept drafts saved steps
    assert sum(g["meta_info"]["spec_verify_ct"] for g in got if "spec_verify_ct" in g["meta_info"]) > 0


def test_drafts_with_sampling_seeds_and_schema(engines):
    """One draw per emitted token from the request's own generator: seeded sampled outputs are identical
    too; a JSON schema's grammar cuts drafts to what it allows, and outputs stay valid."""
    import jsonschema

    plain, spec = engines
    texts = prompts(plain.tokenizer, 8)
    sampled = [{"temperature": 0.8, "top_p": 0.95, "seed": 11 + i, "max_new_tokens": 40} for i in range(8)]
    assert [o["output_ids"] for o in _run(spec, texts, sampled, 4)] == \
        [o["output_ids"] for o in _run(plain, texts, sampled, 4)]
    ask = chat_prompt(plain.tokenizer, "Give this person as JSON with name, born and field: " + TEXTS[3])
    schema = {"json_schema": json.dumps(PERSON), "max_new_tokens": 64}
    params = [dict(schema, temperature=0)] + [dict(schema, temperature=0.7, seed=s) for s in (1, 2)]
    before = spec.get_server_info()["spec_seeded_verifies"]
    ref, got = _run(plain, [ask] * 3, params, 3), _run(spec, [ask] * 3, params, 3)
    for r, g in zip(ref, got):
        assert g["output_ids"] == r["output_ids"]
        assert not list(jsonschema.Draft202012Validator(PERSON).iter_errors(json.loads(g["text"])))
    if spec.args.speculative_algorithm == "NGRAM":  # a lookup guess follows the forced text ('", "born": ')
        assert spec.get_server_info()["spec_seeded_verifies"] > before


def test_stops_inside_a_kept_draft_and_logprobs(engines):
    """A stop string, a stop token or max_new_tokens inside a kept draft ends the output there, as it would
    without drafts; logprobs come per token, the same as without drafts."""
    plain, spec = engines
    text = prompts(plain.tokenizer, 1)[0]
    base = plain.generate(text, {"temperature": 0, "max_new_tokens": 40})
    words = base["text"].split()
    cases = [{"stop": [" ".join(words[6:8])]}, {"max_new_tokens": 13},
             {"stop_token_ids": [base["output_ids"][9]]}]
    for extra in cases:
        params = {"temperature": 0, "max_new_tokens": 40, **extra}
        ref, got = plain.generate(text, params), spec.generate(text, params)
        assert (got["output_ids"], got["text"]) == (ref["output_ids"], ref["text"]), extra
        assert got["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    params = {"temperature": 0, "max_new_tokens": 24}
    ref, got = (e.generate(text, params, return_logprob=True, top_logprobs_num=2) for e in (plain, spec))
    assert got["meta_info"]["spec_verify_ct"] > 0
    for key in ("output_token_logprobs", "output_top_logprobs"):
        for a, b in zip(ref["meta_info"][key], got["meta_info"][key]):
            assert json.dumps(a) == json.dumps(b) or _close(a, b), key


@pytest.mark.slow  # the store's side runs by default in test_scheduler.py, over a scripted model
def test_suffix_drafts_from_earlier_outputs(deterministic):
    """An answer given before is drafted from the shared store: asked again, nearly every token comes from it."""
    plain, spec = deterministic(None), deterministic("SUFFIX")
    text = chat_prompt(plain.tokenizer, "Write a short poem about the sea.")
    params = {"temperature": 0, "max_new_tokens": 48}
    ref = plain.generate(text, params)
    assert spec.generate(text, params)["output_ids"] == ref["output_ids"]
    before = spec.get_server_info()["spec_suffix"]
    again = spec.generate(text, params)
    assert again["output_ids"] == ref["output_ids"]
    assert spec.get_server_info()["spec_suffix"]["drafts_shared"] > before["drafts_shared"]
    assert again["meta_info"]["spec_accept_length"] > 3


def _close(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return math.isclose(a, b, abs_tol=1e-4)
    return a == b


def test_a_draft_models_subset_head_gives_its_tokens_logits(runner):
    """STANDALONE's restricted LM head: column i is token ids[i]'s logit of the full head (8-bit blocks: close)."""
    from plait.runtime.speculative.standalone import SubsetHead

    torch.manual_seed(0)
    ids = torch.tensor(sorted(set(range(1000)) | {2, 49151}))
    head = SubsetHead(runner.model.lm_head, ids)
    x = torch.randn(3, runner.config.hidden_size)
    full = runner.model.lm_head(x).float()[:, ids]
    got = head(x)
    assert got.shape == (3, len(ids))
    assert ((got - full).norm() / full.norm()).item() < 1e-2
    assert torch.equal(ids[got.argmax(-1)], ids[full.argmax(-1)])


def test_speculative_flags_are_validated():
    from plait.runtime.server_args import ServerArgs, default_model_path

    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(model_path=default_model_path(), speculative_algorithm="EAGLE3").resolved()
    with pytest.raises(ValueError, match="speculative_draft_model_path needs"):
        ServerArgs(speculative_draft_model_path="/x")
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        ServerArgs(speculative_eagle_topk=0)
    with pytest.raises(ValueError, match="page_size 1"):
        ServerArgs(speculative_eagle_topk=4, page_size=2)
    with pytest.raises(ValueError, match="STANDALONE needs --speculative-draft-model-path"):
        ServerArgs(speculative_algorithm="STANDALONE").resolved()  # no draft model ships for it
    from plait.runtime.speculative.standalone import _check_vocabulary

    smol, qwen = (SimpleNamespace(tokenizer=None, config=SimpleNamespace(vocab_size=v)) for v in (49152, 151936))
    with pytest.raises(ValueError, match="its vocabulary is not the target's"):
        _check_vocabulary(smol, qwen, "qwen.gguf")
    _check_vocabulary(qwen, qwen, "qwen.gguf")
    resolved = ServerArgs(speculative_algorithm="EAGLE3").resolved()
    assert resolved.speculative_draft_model_path.endswith("SmolLM2-135M-Instruct-EAGLE3")
    assert resolved.speculative_num_steps == resolved.speculative_num_draft_tokens - 1

    with pytest.raises(ValueError, match="speculative_algorithm"):
        ServerArgs(speculative_algorithm="MEDUSA")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        ServerArgs(speculative_num_draft_tokens=1)
    with pytest.raises(ValueError, match="match_window_size"):
        ServerArgs(speculative_ngram_min_match_window_size=4, speculative_ngram_max_match_window_size=2)


def test_draft_sizes_follow_measured_cost_and_acceptance():
    """Drafts are sized by what pays: flat forward costs and likely acceptance draft to the cap; forwards whose
    cost grows with every row (quantized weights) or unlikely acceptance draft little or nothing; a batch size
    never measured runs a plain step first."""
    from plait.runtime.speculative.cost import Acceptance, RowCost, choose_sizes, fill_caps

    def a(*per_token: float) -> list[Acceptance]:
        return [Acceptance(x, x) for x in per_token]

    cost = RowCost()
    assert choose_sizes(cost, 1, a(0.9), [7], 12) == [0]  # nothing measured: measure the plain step
    cost.record(1, 0.080)
    assert choose_sizes(cost, 1, a(0.9), [7], 12) == [7]  # more rows never measured: costed as one row, tried
    for rows, t in ((2, 0.082), (4, 0.112), (8, 0.146), (12, 0.151)):  # float32 on 2 AVX2 cores
        cost.record(rows, t)
    assert choose_sizes(cost, 1, a(0.8), [7], 12)[0] >= 4
    assert choose_sizes(cost, 1, a(0.8), [7], 12, step_seconds=0.03) in ([2], [3])  # a slow draft head costs depth
    assert choose_sizes(cost, 1, a(0.01), [7], 12) == [0]
    quant = RowCost()
    for rows, t in ((1, 0.0168), (2, 0.0255), (4, 0.0362), (8, 0.0653)):  # Q4_1 blocks: every row costs
        quant.record(rows, t)
    assert choose_sizes(quant, 1, a(0.3), [7], 12) == [0]
    assert choose_sizes(quant, 1, a(0.97), [7], 12)[0] >= 3
    # two requests: the likelier one drafts deeper; the token budget bounds the total
    sizes = choose_sizes(cost, 2, a(0.9, 0.5), [7, 7], 6)
    assert sum(sizes) <= 6 and sizes[0] > sizes[1]
    cost.record(3, 0.5)  # measurements replace the optimistic guesses: 3 and 4 rows now cost far more
    cost.record(4, 0.5)
    assert choose_sizes(cost, 2, a(0.9, 0.9), [1, 1], 6) == [0, 0]
    # all or nothing (a copied run): a doubtful first token, then the rest hold. Priced per token, such a draft
    # stays short; priced in two parts it goes deep, the more so as each step costs more than its forward
    cost = RowCost()
    for rows, t in ((1, 0.080), (2, 0.082), (4, 0.112), (8, 0.146)):
        cost.record(rows, t)
    assert choose_sizes(cost, 1, a(0.3), [7], 12, overhead=0.02)[0] <= 2
    assert choose_sizes(cost, 1, [Acceptance(0.3, 0.95)], [7], 12, overhead=0.02)[0] >= 5
    # a draft model's pass, priced by the requests it drafts for: one request's pass is cheap, a pass over two
    # costs more than a second request's first draft token gains, so one request drafts
    passes = RowCost()
    passes.record(1, 0.005)
    passes.record(2, 0.2)
    sizes = choose_sizes(cost, 2, a(0.9, 0.9), [3, 3], 6, step_seconds=passes)
    assert sorted(sizes)[0] == 0 and max(sizes) > 0, sizes
    copying = Acceptance()
    for kept, tried in ((0, 1), (5, 5), (0, 1), (5, 5), (0, 1), (0, 1)):
        copying.update(kept, tried)
    assert copying.first < 0.5 < 0.8 < copying.rest
    # the fixed policy: each its cap; a short budget shared one token at a time
    assert fill_caps([3, 7, 2], 6) == [2, 2, 2] and fill_caps([1, 7], 5) == [1, 4] and fill_caps([3, 2], 12) == [3, 2]
