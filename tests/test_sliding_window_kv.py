"""Sliding-window layers keep only their window in the KV pool (radix_cache/memory_pool.WindowedKVAllocator):

- the radix tree's window bookkeeping (locks over whole nodes across splits, eviction of window slots alone, a
  match cut to where its window is intact, a duplicate's window slots healing a released prefix) keeps its
  invariants, without a model;
- the real scheduler on a tiny random Gemma 3 (window 12: three sliding layers and a global one), batch-invariant,
  with window slots for two requests' windows and a chunk, prefixes shared and outputs running far past the
  window: every output equals the one from a pool that keeps every token, and no slot leaks.
"""

from __future__ import annotations

import random

import msgspec

import pytest
import torch

from plait.radix_cache.memory_pool import WindowedKVAllocator
from plait.radix_cache.radix_cache import RadixCache, intact_prefix
from plait.runtime.ipc.messages import TokenizedGenerateReq
from plait.runtime.model_executor.model_runner import ModelRunner
from plait.runtime.sampling import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs

from conftest import THREADS

WINDOW = 12


def test_intact_prefix_ends_where_the_window_before_it_is_live():
    live = torch.tensor([True] * 10)
    assert intact_prefix(live, 4, 1) == 10
    live[7] = False  # tokens 8, 9 follow a hole: the longest usable end is 7 (tokens 3..6 live)
    assert intact_prefix(live, 4, 1) == 7
    assert intact_prefix(live, 4, 2) == 6
    live[2] = False  # 3..6 is still a whole window
    assert intact_prefix(live, 4, 1) == 7
    live[4] = False  # no run of 4 anywhere before a hole: only a prefix shorter than the window
    assert intact_prefix(live, 4, 1) == 2
    assert intact_prefix(torch.tensor([False, True]), 4, 1) == 0


def _cache(page_size: int, window_slots: int = 128) -> tuple[WindowedKVAllocator, RadixCache]:
    alloc = WindowedKVAllocator(256, page_size, window_slots)
    return alloc, RadixCache(alloc, page_size)


@pytest.mark.parametrize("page_size", [1, 4])
def test_window_locks_cover_whole_nodes_across_splits(page_size):
    alloc, cache = _cache(page_size)
    key = list(range(40))
    slots = alloc.alloc_extend(-1, 0, 40)
    assert cache.insert(key, slots) == 0
    match = cache.match_prefix(key)
    cache.lock(match.node)
    covered = cache.lock_window(match.node, 10)
    assert covered == (12 if page_size == 4 else 10)  # the node was cut at the window's start
    cache.check()
    assert cache.window_evictable == 40 - covered
    # another request's insert splits the locked node inside the window
    other = key[:35] + [99] * 5
    more = alloc.alloc_extend(-1, 0, 40)
    present = cache.insert(other, more)
    assert present == (32 if page_size == 4 else 35)
    alloc.free(more[:present])
    cache.check()
    # evicting window slots takes only what no window covers, and keeps the full KV
    freed = cache.evict_window(1000)
    cache.check()
    assert cache.window_evictable == 0 and freed > 0
    assert bool(alloc.window_live(match.indices[-covered:]).all())
    assert not bool(alloc.window_live(match.indices[: 40 - covered]).any())
    assert len(cache.match_prefix(key).indices) == 40  # full KV is all there
    assert len(cache.match_prefix(key, window=10).indices) == 40  # its window too
    # a shorter prefix whose window was released is not usable past the start of the lock
    assert len(cache.match_prefix(key[:20], window=10).indices) == 0
    cache.unlock_window(match.node, covered)
    cache.unlock(match.node)
    cache.check()
    # a duplicate's live window slots heal the released part of the prefix
    dup = alloc.alloc_extend(-1, 0, 24)
    present = cache.insert(key[:24], dup)
    assert present == 24
    alloc.free(dup[:present])  # the caller frees its duplicates (their window slots went to the tree)
    cache.check()
    assert len(cache.match_prefix(key[:24], window=10).indices) == 24
    cache.evict(10_000)
    cache.check()
    assert alloc.free_slots == alloc.capacity and alloc.window.free_slots == alloc.window.capacity


def test_windowed_allocator_refuses_when_window_slots_run_out():
    alloc = WindowedKVAllocator(128, 1, 16)
    a = alloc.alloc_extend(-1, 0, 10)
    assert alloc.alloc_extend(-1, 0, 10) is None and alloc.free_slots == 127 - 10  # nothing taken
    assert alloc.release_window(a[:6]) == 6
    b = alloc.alloc_extend(-1, 0, 10)
    alloc.free(torch.cat([a, b]))
    assert alloc.free_slots == alloc.capacity and alloc.window.free_slots == alloc.window.capacity


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                              sliding_window=WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    path = tmp_path_factory.mktemp("tiny-gemma3")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _requests(seed: int) -> list[TokenizedGenerateReq]:
    """Prompts sharing a 30-token prefix (some sharing more), outputs of 30-50 tokens: far past the window."""
    rng = random.Random(seed)
    base = [rng.randrange(2, 160) for _ in range(30)]
    reqs = []
    for i in range(10):
        tail = [rng.randrange(2, 160) for _ in range(rng.randrange(3, 40))]
        ids = base + (reqs[-1].input_ids[30:45] if i % 3 == 2 else []) + tail
        params = SamplingParams.from_dict({"max_new_tokens": 30 + 2 * i, "temperature": 0, "ignore_eos": True})
        reqs.append(TokenizedGenerateReq(f"r{seed}-{i}", ids, params))
    return reqs


def _generate(sched: Scheduler, outs: list, reqs: list[TokenizedGenerateReq]) -> dict[str, list[int]]:
    for m in reqs:
        sched.add_request(m)
    for _ in range(5000):
        if not sched.step():
            break
    results: dict[str, list[int]] = {}
    for o in outs:
        results.setdefault(o.rid, []).extend(o.new_ids)
        assert o.finish is None or o.finish.type == "length", o.finish
    outs.clear()
    return results


def _scheduler(path: str, **kw) -> tuple[Scheduler, list]:
    args = ServerArgs(model_path=path, dtype="float32", num_threads=THREADS, skip_tokenizer_init=True,
                      enable_deterministic_inference=True, grammar_backend="none", chunked_prefill_size=16,
                      max_prefill_tokens=32, max_running_requests=4, **kw).resolved()
    outs: list = []
    return Scheduler(args, ModelRunner(args, progress=False), outs.extend), outs


@pytest.mark.parametrize("page_size", [1, 4])
def test_window_only_kv_gives_the_outputs_of_a_pool_that_keeps_every_token(tiny_gemma3, page_size):
    waves = [_requests(1), _requests(1)[::-1], _requests(2)]  # the second wave repeats the first: cache hits
    waves[1] = [msgspec.structs.replace(m, rid=m.rid + "-again") for m in waves[1]]
    ref, ref_outs = _scheduler(tiny_gemma3, max_total_tokens=4096, disable_radix_cache=True, disable_hybrid_swa_memory=True,
                     page_size=page_size)
    assert not ref.kv.window
    want = {}
    for wave in waves:
        want.update(_generate(ref, ref_outs, wave))
    # window slots for two windows and a chunk (40): four requests of up to ~120 tokens run side by side in them
    sched, outs = _scheduler(tiny_gemma3, max_total_tokens=1024, swa_full_tokens_ratio=0.01, page_size=page_size)
    assert sched.kv.window == WINDOW and sched.runner.allocator.window.capacity < 48
    got = {}
    for wave in waves:
        got.update(_generate(sched, outs, wave))
        assert sched.kv.check() is None
    assert got == want
    assert sched.kv.cache.stats().hit_tokens > 0


def test_a_windowed_batch_crosses_the_wire_to_other_ranks(tiny_gemma3):
    """Tensor-parallel ranks run what rank 0 sends: the window slots travel with the batch."""
    from plait.runtime.model_executor import step_sync
    from plait.runtime.model_executor.model_runner import WorkItem

    runner = _scheduler(tiny_gemma3, max_total_tokens=256)[0].runner
    row = runner.req_to_token.alloc()
    slots = runner.allocator.alloc_extend(-1, 0, 20)
    runner.req_to_token.table[row, :20] = slots
    runner.allocator.release_window(slots[:4])
    fb, _ = runner.build_batch([WorkItem(row, 0, list(range(2, 22)), [19])])
    assert torch.equal(fb.windowed.out_slots, runner.allocator.window_of[slots])
    msg = step_sync._DEC.decode(step_sync._ENC.encode(step_sync.forward_msg(fb, ())))
    got = step_sync.forward_batch(msg)
    assert torch.equal(got.windowed.out_slots, fb.windowed.out_slots)
    assert torch.equal(got.windowed.extend.kv_slots, fb.windowed.extend.kv_slots)
    assert torch.equal(got.out_slots, fb.out_slots) and got.windowed.windowed is None
