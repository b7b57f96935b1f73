"""Parallelism on CPU over gloo, with real processes: tensor parallelism gives one rank's greedy tokens on the
default model over HTTP (tiny MoE models split by tensor and expert parallelism: tests/test_moe.py), a dead
rank ends the server within seconds (a local rank; in the slow run also a rank on another "machine" of
--nnodes 2), and --dp-size 2 (slow run) spreads requests over two replicas with the same results."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from plait.runtime.distributed.group import partition
from server_util import THREADS, Server, free_port

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors of the rainbow:"]
GREEDY = {"max_new_tokens": 16, "temperature": 0}
# --nnodes 2 and --dp-size 2 each start a server or engine of their own: the slow run takes them (make test-slow)


def test_partition_covers_in_order_and_keeps_alignment():
    for total, parts, align in [(576, 2, 64), (3, 2, 1), (1536, 3, 32), (160, 2, 32), (49152, 2, 1), (8, 8, 1)]:
        ranges = [partition(total, parts, r, align) for r in range(parts)]
        assert ranges[0].start == 0 and ranges[-1].stop == total
        assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
        assert all(r.start % align == 0 and len(r) > 0 for r in ranges)
        assert max(map(len, ranges)) - min(map(len, ranges)) <= align + total % align
    assert [len(partition(3, 2, r)) for r in range(2)] == [2, 1]  # the default model's 3 KV heads on 2 ranks
    with pytest.raises(ValueError, match="cannot split"):
        partition(3, 4, 0)


def _rank_pids(parent: int, role: str) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent), "-f", f"proc_main {role}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _wait_exit(proc: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    proc.wait(timeout)
    return time.monotonic() - start


def _http_greedy(server: Server, ids: list[list[int]]) -> list[list[int]]:
    with server.client() as c:
        r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        return [o["output_ids"] for o in r.json()]


def _reference(engine, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    ids = [tokenizer.encode(p) for p in PROMPTS]
    ids.append(tokenizer.encode("Summarise: " + "the cat sat on the mat and looked at the dog. " * 60))  # chunked
    return ids, [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=GREEDY)]


def test_launch_server_tp2_serves_the_default_model_and_a_dead_rank_ends_it(engine, tokenizer):
    ids, ref = _reference(engine, tokenizer)
    server = Server("--tp-size", "2", "--dtype", "float32", "--max-total-tokens", "4096")
    try:
        assert _http_greedy(server, ids) == ref  # float32: the same greedy tokens as one rank
        with server.client() as c:
            info = c.get("/server_info").json()
            assert info["tp_size"] == 2 and info["num_threads"] >= 1
            model = c.get("/v1/models").json()["data"][0]["id"]
            chat = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 8,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        ranks = _rank_pids(server.proc.pid, "rank")
        assert len(ranks) == 1, ranks
        subprocess.run(["kill", "-9", str(ranks[0])], check=True)
        assert _wait_exit(server.proc, 20) < 20 and server.proc.returncode == 1
        assert "rank1" in server.output()
        assert not _rank_pids(server.proc.pid, "scheduler")
    finally:
        server.stop(signal.SIGKILL)


@pytest.mark.slow
def test_two_nodes_serve_one_model_and_losing_the_second_ends_the_server(engine, tokenizer):
    """--nnodes 2 on loopback: node 1 runs rank 1 only; node 0 serves HTTP with rank 0. When node 1 goes,
    rank 0's next collective fails and the server exits (it is not node 0's child: only the collective
    can tell)."""
    ids, ref = _reference(engine, tokenizer)
    flags = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}", "--dtype",
             "float32", "--max-total-tokens", "4096", "--num-threads", str(THREADS), "--log-level", "warning"]
    node1 = subprocess.Popen([sys.executable, "-m", "plait.launch_server", *flags, "--node-rank", "1"])
    server = None
    try:
        server = Server(*flags)
        assert _http_greedy(server, ids[:1]) == ref[:1]
        node1.kill()
        assert _wait_exit(server.proc, 30) < 30 and server.proc.returncode == 1
    finally:
        node1.kill()
        if server is not None:
            server.stop(signal.SIGKILL)


@pytest.mark.slow
def test_dp2_spreads_requests_over_two_replicas(engine, tokenizer):
    from plait import Engine

    ids, ref = _reference(engine, tokenizer)
    eng = Engine(dp_size=2, dtype="float32", max_total_tokens=4096, num_threads=THREADS, log_level="warning")
    try:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(len(ids)) as pool:  # one request each, at once: the least loaded replica
            outs = list(pool.map(lambda x: eng.generate(input_ids=x, sampling_params=GREEDY)["output_ids"], ids))
        assert outs == ref
        info = eng.get_server_info()
        assert [r["forward_passes"] > 0 for r in info["replicas"]] == [True, True]
        assert info["forward_passes"] == sum(r["forward_passes"] for r in info["replicas"])
        join = eng.join_kv("Some shared text.", [" First branch.", " Second branch."])
        assert join["join_id"] is not None
        out = eng.generate("Some shared text. First branch. Second branch.", GREEDY, kv_joins=[join["join_id"]])
        assert out["meta_info"]["cached_tokens"] > 0  # routed to the replica that holds the join
        assert eng.flush_cache()
    finally:
        eng.shutdown()


def test_more_ranks_than_kv_heads_are_refused_naming_the_limit():
    from transformers import OlmoeConfig

    from plait.runtime.distributed.group import Group
    from plait.runtime.model_config import ModelConfig
    from plait.runtime.models.llama import local_heads

    cfg = ModelConfig.from_hf(OlmoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))
    assert [local_heads(cfg, Group(r, 2)) for r in range(2)] == [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]
    with pytest.raises(ValueError, match="tp_size 3 is more than the model's 2 KV heads"):
        local_heads(cfg, Group(0, 3))


_COLLECTIVES = r"""
import sys, torch
from plait.runtime.distributed.group import init_group
rank, port = int(sys.argv[1]), sys.argv[2]
g = init_group(rank, 2, f"127.0.0.1:{port}", False, 30)
assert g.shm is not None  # one x86 machine: shared memory
for rows in (1, 512, 4000):  # 4000 x 576 float32 is over a slot's 8 MiB: gloo, chosen alike on both ranks
    x = torch.full((rows, 576), float(rank + 1))
    assert (g.all_reduce(x) == 3).all()
part = torch.arange(10.0).view(5, 2) + 100 * rank
got = g.all_gather(part if rank == 0 else part[:3], [5, 3])  # uneven shares
assert got[:, 0].tolist() == [0, 2, 4, 6, 8, 100, 102, 104], got
for payload in (b"step", b"x" * (9 << 20)):  # the second is larger than a slot: sent over gloo
    assert g.broadcast_bytes(payload if rank == 0 else None) == payload
g.close()
print("ok")
"""


def test_shared_memory_collectives_and_their_gloo_fallbacks():
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _COLLECTIVES, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (1, 0)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 and out.strip() == "ok" for p, (out, _) in zip(procs, outs)), outs


@pytest.mark.slow
def test_eagle_head_beside_a_target_split_across_two_ranks(engine, tokenizer):
    """The head runs on rank 0 alone over whole copies of the vocabulary layers: drafts are verified by the
    split target and the tokens are one rank's."""
    from plait import Engine

    ids, ref = _reference(engine, tokenizer)
    eng = Engine(tp_size=2, speculative_algorithm="EAGLE3", dtype="float32", max_total_tokens=4096,
                 log_level="warning")
    try:
        outs = eng.generate(input_ids=ids[:3], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == ref[:3]
        assert eng.get_server_info()["spec_verifies"] > 0
    finally:
        eng.shutdown()
