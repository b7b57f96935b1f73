"""Engine end to end on the real default model."""

import asyncio

import pytest
import torch

from plait import Engine

from conftest import THREADS, chat_prompt

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about autumn leaves.",
    "Why is the sky blue? Answer in one sentence.", "List two prime numbers.", "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.", "What is 12 times 12?", "Give me a synonym for happy.",
    "Describe a cat in five words.", "What does CPU stand for?", "Suggest a name for a pet goldfish.",
    "How many days are in a leap year?", "What is the boiling point of water in Celsius?",
    "Explain photosynthesis to a child, briefly, using simple words and one example from everyday life.",
    "Hi",
]
GREEDY = {"temperature": 0, "max_new_tokens": 20}


def test_batch_greedy_equals_transformers_one_at_a_time(engine, tokenizer, hf_model):
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    outs = engine.generate(prompts, GREEDY)
    assert len(outs) == 16
    for prompt, out in zip(prompts, outs):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        ref_ids = ref[0, len(ids):].tolist()
        if ref_ids and ref_ids[-1] == tokenizer.eos_token_id:
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
        assert out["output_ids"] == ref_ids, prompt
        assert out["text"] == tokenizer.decode(ref_ids, skip_special_tokens=True)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["meta_info"]["completion_tokens"] == len(ref_ids)


def test_shared_prefix_is_computed_once(engine, tokenizer):
    assert engine.flush_cache()
    shots = "".join(f"Q: What is {a} plus {b}?\nA: {a + b}.\n" for a in range(3, 40, 3) for b in (4, 9, 11))
    prefix = tokenizer.encode("You are a careful calculator.\n" + shots)
    assert len(prefix) > 600  # longer than one prefill chunk (512)
    questions = [tokenizer.encode(f"{w} is 7 plus 8?\nA:") for w in ("What", "Who", "Where", "Why", "How", "Which")]
    assert len({q[0] for q in questions}) == len(questions)  # they diverge right after the prefix
    outs = engine.generate(input_ids=[prefix + q for q in questions], sampling_params={"temperature": 0,
                                                                                        "max_new_tokens": 4})
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached == [0] + [len(prefix)] * (len(questions) - 1)
    again = engine.generate(input_ids=prefix + questions[0], sampling_params={"temperature": 0, "max_new_tokens": 4})
    assert again["meta_info"]["cached_tokens"] == len(prefix) + len(questions[0]) - 1  # all but the last token
    assert again["output_ids"] == outs[0]["output_ids"]


def test_prefill_only_request_caches_the_prompt(engine, tokenizer):
    engine.flush_cache()
    ids = tokenizer.encode(chat_prompt(tokenizer, "Tell me about the moon and its phases."))
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length"}
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    assert out["meta_info"]["cached_tokens"] == len(ids) - 1


def test_seeded_sampling_is_batch_invariant(engine, tokenizer):
    p = chat_prompt(tokenizer, "Write a short poem about rivers.")
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 24, "seed": 1234}
    alone = engine.generate(p, params)
    others = [chat_prompt(tokenizer, q) for q in QUESTIONS[:5]]
    batch = engine.generate([others[0], p, *others[1:]],
                            [{"temperature": 1.0, "max_new_tokens": 30}, params] + [{"temperature": 0.7}] * 4)
    assert batch[1]["output_ids"] == alone["output_ids"]
    other_seed = engine.generate(p, {**params, "seed": 99})
    assert other_seed["output_ids"] != alone["output_ids"]


def test_stop_conditions(engine, tokenizer):
    p = chat_prompt(tokenizer, "Count from 1 to 20, separated by commas.")
    base = engine.generate(p, {"temperature": 0, "max_new_tokens": 40})
    text = base["text"]
    assert "5" in text
    stop = engine.generate(p, {"temperature": 0, "max_new_tokens": 40, "stop": "5"})
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": "5"}
    assert stop["text"] == text[: text.index("5")]
    kept = engine.generate(p, {"temperature": 0, "max_new_tokens": 40, "stop": ["5"], "no_stop_trim": True})
    assert kept["text"] == text[: text.index("5") + 1]
    tok = base["output_ids"][3]
    by_id = engine.generate(p, {"temperature": 0, "max_new_tokens": 40, "stop_token_ids": [tok]})
    assert by_id["output_ids"] == base["output_ids"][: base["output_ids"].index(tok) + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}

    short = engine.generate(chat_prompt(tokenizer, "Hi"), {"temperature": 0, "max_new_tokens": 64})
    assert short["meta_info"]["finish_reason"]["type"] == "stop"
    n = short["meta_info"]["completion_tokens"]
    longer = engine.generate(chat_prompt(tokenizer, "Hi"), {"temperature": 0, "max_new_tokens": 64,
                                                            "min_new_tokens": n + 5})
    assert longer["meta_info"]["completion_tokens"] >= n + 5
    assert tokenizer.eos_token_id not in longer["output_ids"][: n + 5]
    ignore = engine.generate(chat_prompt(tokenizer, "Hi"), {"temperature": 0, "max_new_tokens": n + 3,
                                                            "ignore_eos": True})
    assert ignore["meta_info"]["completion_tokens"] == n + 3
    assert ignore["meta_info"]["finish_reason"] == {"type": "length"}


def test_logprobs_match_transformers(engine, tokenizer, hf_model):
    p = chat_prompt(tokenizer, "Name a fruit.")
    ids = tokenizer.encode(p)
    out = engine.generate(p, {"temperature": 0, "max_new_tokens": 6}, return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=3)
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(ids) and inp[0][0] is None and inp[0][1] == ids[0]
    for i in range(1, len(ids)):
        assert inp[i][1] == ids[i]
        assert abs(inp[i][0] - ref[i - 1, ids[i]].item()) < 1e-3
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == out["output_ids"]
    for k, (lp, tok, _) in enumerate(outp):
        assert abs(lp - ref[len(ids) - 1 + k, tok].item()) < 1e-3
        top = meta["output_top_logprobs"][k]
        assert len(top) == 3 and top[0][1] == tok and top[0][0] >= top[1][0] >= top[2][0]

    later = engine.generate(p, {"temperature": 0, "max_new_tokens": 1}, return_logprob=True, logprob_start_len=5)
    assert [t for _, t, _ in later["meta_info"]["input_token_logprobs"]] == ids[5:]
    assert abs(later["meta_info"]["input_token_logprobs"][0][0] - ref[4, ids[5]].item()) < 1e-3


def test_streaming_sync_and_async(engine, tokenizer):
    p = chat_prompt(tokenizer, "Say something nice about mornings.")
    params = {"temperature": 0, "max_new_tokens": 24}
    full = engine.generate(p, params)
    snaps = list(engine.generate(p, params, stream=True))
    assert len(snaps) > 3
    assert all(b["text"].startswith(a["text"]) for a, b in zip(snaps, snaps[1:]))
    assert snaps[-1]["text"] == full["text"] and snaps[-1]["output_ids"] == full["output_ids"]

    async def run():
        single = await engine.async_generate(p, params)
        stream = await engine.async_generate(p, params, stream=True)
        last = None
        async for snap in stream:
            last = snap
        return single, last

    single, last = asyncio.run(run())
    assert single["text"] == full["text"] == last["text"]


@pytest.mark.parametrize("kwargs,match", [
    ({"prompt": "hi", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ({"prompt": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"prompt": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"prompt": "hi", "input_ids": [1, 2]}, "exactly one"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, 10**7]}, "input_ids"),
    ({"input_ids": list(range(9000))}, "context length"),
    ({"prompt": ["a", "b"], "sampling_params": [{}]}, "entries"),
])
def test_bad_input_is_rejected_and_engine_keeps_serving(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)
    assert engine.generate("Hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


@pytest.mark.slow  # retraction's bookkeeping runs by default in test_scheduler.py, over a scripted model
def test_small_kv_pool_serves_16_concurrent_requests(engine, tokenizer):
    """A pool for about 4 requests: admission waits, decoding retracts and resumes; nothing is lost
    and every output equals the same request on the big pool (paged KV, page_size 4, too)."""
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    expected = engine.generate(prompts, params)
    small = Engine(num_threads=THREADS, max_total_tokens=4 * 100, page_size=4, chunked_prefill_size=64,
                   dtype="float32", log_level="warning")
    try:
        outs = small.generate(prompts, params)
        stats = small.get_server_info()
    finally:
        small.shutdown()
    assert [o["output_ids"] for o in outs] == [e["output_ids"] for e in expected]
    assert all(o["meta_info"]["completion_tokens"] == 48 for o in outs)
    assert stats["num_retracted"] > 0
    assert stats["kv_free"] + stats["cache_tokens"] == stats["kv_capacity"]  # no leaked slots


@pytest.mark.slow  # as the pool above
def test_disabled_radix_cache_gives_same_outputs(engine, tokenizer):
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS[:4]]
    params = {"temperature": 0, "max_new_tokens": 12}
    expected = engine.generate(prompts, params)
    plain = Engine(num_threads=THREADS, max_total_tokens=4096, disable_radix_cache=True, schedule_policy="fcfs",
                   dtype="float32", log_level="warning")
    try:
        outs = plain.generate(prompts + prompts, params)
        stats = plain.get_server_info()
    finally:
        plain.shutdown()
    assert [o["output_ids"] for o in outs] == [e["output_ids"] for e in expected] * 2
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    assert stats["kv_free"] == stats["kv_capacity"]

