"""KV joins (join(mode="concate_and_append")): the branches' KV becomes the joined sequence's KV
without a forward, and the radix cache stays exact for every request that does not name the join.
Runs the real scheduler and model in this process."""

from __future__ import annotations

import pytest
import torch

from conftest import THREADS
from plait.runtime.ipc.messages import JoinKVReq, TokenizedGenerateReq
from plait.runtime.model_executor.model_runner import ModelRunner
from plait.runtime.sampling import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs

FORK = "Read the facts, then answer the question.\nFacts:\n"
BRANCHES = ["- Ethan is the father of Liam.\n", "- Noah is the father of Julian.\n", "- Oliver is the father of Carlos.\n"]


class Harness:
    def __init__(self, dtype: str):
        args = ServerArgs(num_threads=THREADS, max_total_tokens=2048, dtype=dtype, log_level="warning").resolved()
        self.runner = ModelRunner(args, progress=False)
        self.outs = []
        self.sch = Scheduler(args, self.runner, self.outs.extend)
        self.tok = self.runner.tokenizer

    def run(self, rid: str, ids: list[int], joins: tuple[str, ...] = (), max_new_tokens: int = 0):
        self.sch.add_request(TokenizedGenerateReq(rid, ids, SamplingParams(max_new_tokens=max_new_tokens,
                                                                           temperature=0), kv_joins=list(joins)))
        while self.sch.step():
            pass
        mine = [o for o in self.outs if o.rid == rid]
        return mine[-1].cached_tokens, [t for o in mine for t in o.new_ids]

    def parts(self) -> tuple[list[int], list[list[int]]]:
        fork = self.tok.encode(FORK)
        return fork, [self.tok.encode(FORK + b) for b in BRANCHES]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def h(request):
    return Harness(request.param)


def test_join_reuses_the_branches_kv_and_keeps_the_cache_exact(h):
    fork, parts = h.parts()
    for i, p in enumerate(parts):
        h.run(f"branch{i}", p)
    info = h.sch.join_kv(JoinKVReq("join1", parts, len(fork)))
    joined = parts[0] + [t for p in parts[1:] for t in p[len(fork):]]
    assert info == {"join_id": "join1", "input_ids": joined, "reused": len(joined)}
    assert h.tok.decode(joined) == FORK + "".join(BRANCHES)  # the same text as the plain join

    question = h.tok.encode("Question: Who is the father of Julian?\nAnswer:")
    cached, _ = h.run("after", joined + question, joins=("join1",), max_new_tokens=4)
    assert cached == len(joined)  # nothing the branches computed is computed again
    # a request that names no join gets only causal KV: the fork and branch 0, not the joined tails
    cached, plain_out = h.run("plain", joined + question, max_new_tokens=4)
    assert cached == len(parts[0])
    h.sch.kv.cache.evict(10**6)  # the same request with nothing cached answers the same
    assert h.run("fresh", joined + question, max_new_tokens=4)[1] == plain_out
    assert h.sch.kv.check() is None


def test_joined_keys_are_the_branches_keys_at_their_new_positions(h):
    """Layer 0's K and V depend on the token and its position only, so the re-rotated copy must
    equal what a causal prefill of the joined sequence writes (deeper layers differ by design:
    each branch attended to the fork alone)."""
    fork, parts = h.parts()
    for i, p in enumerate(parts):
        h.run(f"b{i}", p)
    joined = h.sch.join_kv(JoinKVReq("join2", parts, len(fork)))["input_ids"]
    h.run("causal", joined)
    cache = h.sch.kv.cache
    join_slots = cache.match_prefix(joined, joins=("join2",)).indices
    causal_slots = cache.match_prefix(joined).indices
    assert len(join_slots) == len(causal_slots) == len(joined)
    tail = slice(len(parts[0]), len(joined))
    assert not torch.equal(join_slots[tail], causal_slots[tail])
    pool = h.runner.kv_pool
    k_join, k_causal = pool.k[0][:, join_slots[tail]].float(), pool.k[0][:, causal_slots[tail]].float()
    v_join, v_causal = pool.v[0][:, join_slots[tail]].float(), pool.v[0][:, causal_slots[tail]].float()
    # the two prefills ran at other batch shapes (another matmul blocking); bf16 rounds the rotated copy again
    tol = 1e-5 if pool.k[0].dtype == torch.float32 else 2e-2
    torch.testing.assert_close(k_join, k_causal, rtol=tol, atol=tol * k_causal.abs().max().item())
    torch.testing.assert_close(v_join, v_causal, rtol=tol, atol=tol * v_causal.abs().max().item())
    assert h.sch.kv.check() is None


def test_join_refuses_what_it_cannot_build(h):
    fork, parts = h.parts()
    for i, p in enumerate(parts):
        h.run(f"c{i}", p)
    assert h.sch.kv.flush()
    assert h.sch.join_kv(JoinKVReq("join3", parts, len(fork))) == {"reason": "a branch's KV is no longer cached"}
    assert "fork prefix" in h.sch.join_kv(JoinKVReq("join4", [parts[0], [1, 2, 3]], len(fork)))["reason"]
    assert "two or more" in h.sch.join_kv(JoinKVReq("join5", parts[:1], len(fork)))["reason"]
    assert h.sch.kv.check() is None
