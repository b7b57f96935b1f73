"""--enable-deterministic-inference: a request's logits and tokens do not depend on what shares its
batch, how its prompt was chunked, or whether its prefix came from the cache, in float32 and in
bfloat16 (batch-invariant kernels). And the bfloat16 weights' logits against transformers' float32."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from plait.kernels import cpu_isa
from plait.runtime.forward.batch import ForwardMode
from plait.runtime.model_executor.model_runner import ModelRunner, WorkItem
from plait.runtime.server_args import ServerArgs

from conftest import THREADS
from server_util import Server

pytestmark = pytest.mark.skipif(cpu_isa.selected() == "ref", reason="PLAIT_CPU_ISA=ref: no batch-invariant kernels")

PROMPT = "The history of Paris begins with a small settlement on an island in the river Seine. " * 6


def _runner(dtype: str) -> ModelRunner:
    args = ServerArgs(dtype=dtype, max_total_tokens=4096, num_threads=THREADS, enable_deterministic_inference=True)
    return ModelRunner(args.resolved(), progress=False)


class _Seq:
    """A sequence with its own request row and KV slots in the runner."""

    def __init__(self, runner: ModelRunner, ids: list[int], prefix: "_Seq | None" = None, shared: int = 0):
        self.runner, self.ids = runner, ids
        self.row = runner.req_to_token.alloc()
        own = runner.allocator.alloc_extend(-1, 0, len(ids) - shared)
        slots = own if prefix is None else torch.cat([runner.req_to_token.table[prefix.row, :shared], own])
        runner.req_to_token.table[self.row, : len(ids)] = slots

    def item(self, start: int, end: int, mode: ForwardMode = ForwardMode.EXTEND) -> WorkItem:
        return WorkItem(self.row, start, self.ids[start:end], list(range(end - start)), mode)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request):
    return _runner(request.param)


def test_logits_do_not_depend_on_chunking_batch_or_cache(runner):
    tok = runner.tokenizer
    ids = tok.encode(PROMPT + "Its name comes from")
    n = len(ids)
    assert n > 64  # long enough that a shared prefix would take the cascade path without the flag

    def alone(chunks: list[int]) -> torch.Tensor:
        seq, out, pos = _Seq(runner, ids), [], 0
        for c in chunks:
            out.append(runner.forward([seq.item(pos, pos + c)]).logits)
            pos += c
        return torch.cat(out)

    whole = alone([n])
    assert torch.equal(alone([5, n - 6, 1]), whole)
    assert torch.equal(alone([1] * 8 + [n - 8]), whole)

    # the same tokens amid others: a prefill of another prompt and decodes that share this one's cached prefix
    other = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    first = _Seq(runner, ids)
    runner.forward([first.item(0, n - 1)])
    sharers = [_Seq(runner, ids[: n - 1] + [t], prefix=first, shared=n - 1) for t in tok.encode(" a b c")]
    stranger = _Seq(runner, other)
    logits = runner.forward([stranger.item(0, len(other)), first.item(n - 1, n, ForwardMode.DECODE)]
                            + [s.item(n - 1, n, ForwardMode.DECODE) for s in sharers]).logits
    assert torch.equal(logits[len(other)], whole[n - 1])
    batch, _ = runner.build_batch([first.item(n - 1, n, ForwardMode.DECODE)] + [s.item(n - 1, n, ForwardMode.DECODE) for s in sharers])
    assert batch.decode.prefix_slots is None  # no cascade split: its result would depend on the batch


def test_bfloat16_weights_track_transformers_float32(hf_model):
    """Stated tolerance for bf16 weights (float32 arithmetic): top-1 agreement >= 95% of positions and
    |delta logprob| of transformers' top token < 0.1 at every position, on three prompts."""
    bf16 = _runner("bfloat16")
    agree, total, worst = 0, 0, 0.0
    for text in ("The history of Paris begins with a small settlement on an island in the river Seine.",
                 "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                 "Photosynthesis is the process by which green plants use sunlight to"):
        ids = bf16.tokenizer.encode(text)
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
        ours = torch.log_softmax(bf16.forward([_Seq(bf16, ids).item(0, len(ids))]).logits, -1)
        top = ref.argmax(-1, keepdim=True)
        agree += int((ours.argmax(-1, keepdim=True) == top).sum())
        total += len(ids)
        worst = max(worst, (ref.gather(1, top) - ours.gather(1, top)).abs().max().item())
    assert agree >= 0.95 * total and worst < 0.1, (agree, total, worst)


def test_seeded_sampling_is_the_same_under_concurrent_load_in_bfloat16():
    """The same seeded, sampled request alone, amid 12 concurrent others, and again with its prompt cached."""
    srv = Server("--max-total-tokens", "16384", "--dtype", "bfloat16", "--enable-deterministic-inference",
                 "--max-running-requests", "16")
    body = {"text": PROMPT + "Write one sentence about the city:",
            "sampling_params": {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_new_tokens": 24}}

    async def load() -> list[dict]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
            others = [client.post("/generate", json={"text": f"Story {i}: " + "once upon a time " * (i + 1),
                                                      "sampling_params": {"temperature": 0.8, "seed": i,
                                                                          "max_new_tokens": 8 + 2 * i}})
                      for i in range(12)]
            rs = await asyncio.gather(*others[:6], client.post("/generate", json=body), *others[6:])
            return [r.json() for r in rs]

    try:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            c.post("/flush_cache").raise_for_status()
            alone = c.post("/generate", json=body).json()
            busy = asyncio.run(load())[6]
            cached = c.post("/generate", json=body).json()
        assert cached["meta_info"]["cached_tokens"] > 64
        assert busy["output_ids"] == alone["output_ids"] == cached["output_ids"]
    finally:
        assert srv.stop() == 0
