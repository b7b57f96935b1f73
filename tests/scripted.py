"""The real Scheduler over a scripted model: a stand-in for ModelRunner whose next-token logits the test chooses.

Its KV cache holds each slot's token. The logits at a position are the script's choice given the tokens read back
through the request's row of the req->token table (a draft tree's node reads its ancestors' slots), so a leaked,
stale or wrongly kept slot changes what the script sees, and the output then differs from the reference the test
computes on the true sequence. The tokenizer and the end ids are the default model's (the grammar backends and the
stop strings need a real one); no weights are loaded, so a scheduler test runs in milliseconds.
"""

from __future__ import annotations

import time
from functools import lru_cache
from types import SimpleNamespace
from typing import Callable

import torch

from plait.radix_cache.memory_pool import KVAllocator, ReqToTokenPool
from plait.runtime.ipc.messages import TokenizedGenerateReq
from plait.runtime.forward.batch import FINAL_HIDDEN, tree_depths
from plait.runtime.model_executor.model_runner import ForwardOutput, WorkItem
from plait.runtime.sampling import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs

# the script: the tokens up to and including a position -> the next token, or a whole row of logits
Script = Callable[[tuple[int, ...]], "int | torch.Tensor"]
LEAD = 30.0  # the scripted token's logit over the rest (0): sampled at temperature 1 with odds of ~1e-8 otherwise


@lru_cache(maxsize=1)
def default_vocab():
    """(tokenizer, vocabulary size, end ids) of the default model, read from its GGUF header."""
    from plait.runtime.model_loader.tokenizer import grammar_vocab
    from plait.runtime.server_args import default_model_path

    return grammar_vocab(default_model_path())


def hashed(low: int = 1000, span: int = 500) -> Script:
    """A script that looks back: the next token mixes the last three tokens and the position, drawn from
    [low, low + span) (ordinary text tokens, away from the end ids)."""
    def script(ctx: tuple[int, ...]) -> int:
        a, b, c = (ctx[-3:] if len(ctx) >= 3 else (0,) * (3 - len(ctx)) + ctx)
        return low + (a * 7 + b * 131 + c * 31 + len(ctx) * 17) % span
    return script


def varied(ctx: tuple[int, ...]) -> torch.Tensor:
    """A script whose preferences change with the last tokens: a grammar's choices differ from step to step."""
    g = torch.Generator().manual_seed(hash(ctx[-3:]) & 0xFFFFFFFF)
    return torch.rand(default_vocab()[1], generator=g)


HIDDEN = 3  # the scripted "final hidden state" of a token: (its id, its position, 1)


def hidden_states(item: WorkItem) -> torch.Tensor:
    """[len(tokens), HIDDEN]: what an embedding pools, known exactly (a mean over chunks can be checked)."""
    pos = torch.arange(item.cached_len, item.cached_len + len(item.tokens), dtype=torch.float32)
    return torch.stack([torch.tensor(item.tokens, dtype=torch.float32), pos, torch.ones_like(pos)], dim=1)


class ScriptedRunner:
    """What Scheduler reads of a ModelRunner, with a scripted forward."""

    def __init__(self, script: Script, num_slots: int = 4096, max_running_requests: int = 16,
                 context_length: int = 2048, page_size: int = 1):
        self.script = script
        self.tokenizer, vocab_size, eos = default_vocab()
        self.config = SimpleNamespace(vocab_size=vocab_size, eos_token_ids=eos, causal=True, hidden_size=HIDDEN,
                                      matryoshka=False, pooling="last")
        self.context_length = context_length
        self.allocator = KVAllocator(num_slots, page_size)
        self.req_to_token = ReqToTokenPool(max_running_requests + 8, context_length + 1)
        self.kv_window = 0
        self.weight_bytes = 0
        self.lora = None  # no LoRA adapters
        self.slot_token = torch.full((num_slots,), -1, dtype=torch.int64)  # the "KV": each slot's token
        self.forwards: list[list[WorkItem]] = []  # every forward's items, for tests of what ran together
        self.fail_next: Exception | None = None  # raised by the next forward (a runner fault)

    def describe(self) -> dict:
        return {}

    def forward(self, items: list[WorkItem], capture: tuple[int, ...] = ()) -> ForwardOutput:
        if capture not in ((), (FINAL_HIDDEN,)):
            raise NotImplementedError("the scripted runner has no layers to capture (EAGLE)")
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        self.forwards.append(items)
        rows = []
        for it in items:
            row = self.req_to_token.table[it.row]
            n = len(it.tokens)
            slots = row[it.cached_len : it.cached_len + n]
            self.slot_token[slots] = torch.tensor(it.tokens, dtype=torch.int64)
            for off in it.logit_offsets:
                rows.append(self._logits(self._context(row, it, off)))
        logits = torch.stack(rows) if rows else torch.zeros(0, self.config.vocab_size)
        return ForwardOutput(logits, [hidden_states(it) for it in items] if capture else None)

    def _context(self, row: torch.Tensor, it: WorkItem, off: int) -> tuple[int, ...]:
        """The tokens position `off` of the item attends to, read back from the KV slots."""
        if it.tree is None or off == 0:
            slots = row[: it.cached_len + off + 1]
        else:  # a draft-tree node: the keys up to the sampled token, then its ancestors and itself
            chain, node = [], off - 1
            while node >= 0:
                chain.append(node)
                node = it.tree[node]
            base = it.cached_len + 1
            slots = torch.cat([row[:base], row[[base + a for a in reversed(chain)]]])
            assert len(slots) == it.cached_len + 1 + tree_depths(it.tree)[off - 1]
        ctx = self.slot_token[slots]
        assert bool((ctx >= 0).all()), "a position read a slot nothing was written to"
        return tuple(ctx.tolist())

    def _logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        out = self.script(ctx)
        if isinstance(out, torch.Tensor):
            return out.float()
        logits = torch.zeros(self.config.vocab_size)
        logits[out] = LEAD
        return logits

    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor) -> None:
        self.slot_token[dst] = self.slot_token[src]


def scheduler(script: Script, *, num_slots: int = 4096, context_length: int = 2048,
              **args) -> tuple[Scheduler, list]:
    """A real Scheduler over a ScriptedRunner; `args` are ServerArgs fields. Returns it and the list its
    outputs go to."""
    from plait.runtime.server_args import default_model_path

    base = dict(model_path=default_model_path(), log_level="warning", max_total_tokens=num_slots,
                context_length=context_length)
    server = ServerArgs(**{**base, **args}).resolved()
    runner = ScriptedRunner(script, num_slots, server.max_running_requests, context_length, server.page_size)
    outs: list = []
    return Scheduler(server, runner, outs.extend), outs


def msg(rid: str, prompt: list[int], **params) -> TokenizedGenerateReq:
    """A greedy request of 16 tokens unless `params` say otherwise; `return_logprob` and the like go in
    `params` too."""
    fields = {k: params.pop(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num", "group",
                                         "kv_joins") if k in params}
    p = SamplingParams.from_dict({"max_new_tokens": 16, "temperature": 0, **params})
    return TokenizedGenerateReq(rid, list(prompt), p, **fields)


def drain(sched: Scheduler, outs: list, max_steps: int = 10_000, timeout: float = 60.0,
          between: Callable[[Scheduler, int], None] | None = None) -> dict[str, dict]:
    """Step until idle; returns each request's {"ids", "finish", "logprobs", "top", "input_logprobs", "last"} (its
    last TokenOut). `between(sched, step)` runs before each step (aborts, new requests, planted faults)."""
    deadline = time.monotonic() + timeout
    for step in range(max_steps):
        if between is not None:
            between(sched, step)
        if not sched.step():
            break
        assert time.monotonic() < deadline, "the scheduler did not finish in time"
    else:
        raise AssertionError(f"not idle after {max_steps} steps")
    results: dict[str, dict] = {}
    for o in outs:
        r = results.setdefault(o.rid, {"ids": [], "finish": None, "logprobs": [], "top": [], "input_logprobs": []})
        r["ids"] += o.new_ids
        r["logprobs"] += [lp for lp, _ in o.output_logprobs]
        r["top"] += o.output_top_logprobs
        r["input_logprobs"] += o.input_logprobs
        r["finish"] = o.finish or r["finish"]
        r["last"] = o
    outs.clear()
    return results


def reference(script: Script, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding of the script on the true sequence: what a correct scheduler outputs."""
    ids = list(prompt)
    while len(ids) < len(prompt) + max_new_tokens:
        nxt = script(tuple(ids))
        ids.append(int(nxt.argmax()) if isinstance(nxt, torch.Tensor) else nxt)
    return ids[len(prompt):]
