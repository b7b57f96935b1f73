"""The runtime's client side: tokenize and validate, send to the scheduler, gather the
detokenizer's outputs per request. Runs on an asyncio loop; the HTTP server and `Engine`
(hence the DSL's `Runtime`) both use this one class.

Results have the shape of SGLang's /generate response (result.py).

With --dp-size N the client talks to N schedulers (replicas): each request goes whole (all its
sequences) to the replica with the fewest requests in flight, a request that reuses a KV join to
the replica that holds it; aborts follow their request; cache flushes and server info go to every
replica and their answers are combined.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from plait.runtime.ipc.messages import (
    AbortReq,
    BatchStrOut,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    JoinKVReq,
    LoadLoRAReq,
    SchedulerStats,
    ServerInfoReq,
    TokenizedGenerateReq,
    ToClient,
    UnloadLoRAReq,
)
from plait.runtime.launch.launcher import RuntimeProcesses
from plait.runtime.ipc.limits import RuntimeLimits, check_kv_joins, check_request_work, validate_request
from plait.runtime.client.request import (GenerateInput, QueueFull, ReqState, RequestFailed, RuntimeDead,
                                          raise_if_rejected)
from plait.runtime.client.embeddings import EmbedInput, finish_vector
from plait.runtime.client.result import sglang_result

logger = logging.getLogger(__name__)

_WATCH_INTERVAL = 0.2
# prompts of this many characters or more are tokenized on a worker thread, off the event loop
_THREAD_TOKENIZE_CHARS = 4096


class RuntimeClient:
    """Talks to the scheduler and detokenizer processes of one runtime. Create it on the loop
    that will use it, after `launch_runtime`."""

    def __init__(self, rt: RuntimeProcesses, metrics=None, on_death: Callable[[str], None] | None = None):
        self.rt = rt
        self.args = rt.args
        self.tokenizer = rt.tokenizer
        self.limits = rt.limits
        self.lora_adapters: set[str] = set(rt.lora_adapters)  # the LoRA adapters the server serves, by name
        # the --embedding-model's (None: there is none)
        self.encoder_limits, self.encoder_tokenizer = rt.encoder_limits, rt.encoder_tokenizer
        self.metrics = metrics
        self.on_death = on_death
        self.ctx = zmq.asyncio.Context()
        self._outs = []  # one per data-parallel replica
        for replica in range(self.args.dp_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(rt.addrs.scheduler_of(replica))
            self._outs.append(sock)
        self._join_replica: dict[str, int] = {}  # KV join id -> the replica holding it
        self._next_replica = 0
        self._in = self.ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(rt.addrs.client)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ToClient)
        self.states: dict[str, ReqState] = {}
        self._max_prompt_chars = _max_prompt_chars(self.tokenizer, self.limits.context_length)
        self._encoder_max_chars = (_max_prompt_chars(self.encoder_tokenizer, self.encoder_limits.context_length)
                                   if self.encoder_limits else 0)
        self._replies: dict[str, asyncio.Future] = {}
        self._replica_stats: dict[int, SchedulerStats] = {}
        self.dead: str | None = None
        self.draining = False  # set on SIGTERM: new requests get 503, in-flight ones finish
        self._tasks = [asyncio.ensure_future(self._read_loop()), asyncio.ensure_future(self._watch_loop())]

    # ---- requests ---------------------------------------------------------------------
    async def tokenize_async(self, inp: GenerateInput) -> list[TokenizedGenerateReq]:
        """`tokenize`, on a worker thread when the texts are long (the event loop serves others meanwhile)."""
        if inp.texts is not None and sum(len(t) for t in inp.texts) >= _THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.tokenize, inp)
        return self.tokenize(inp)

    def encode(self, text: str, field: str = "text", **kw) -> list[int]:
        """The tokenizer's ids for a prompt; a text too long to fit the context in any tokenization is
        refused before spending a core on it."""
        if len(text) > self._max_prompt_chars:
            raise ValueError(f"{field} has {len(text)} characters, more than fit this model's context length of "
                             f"{self.limits.context_length} tokens")
        return self.tokenizer.encode(text, **kw)

    def tokenize(self, inp: GenerateInput) -> list[TokenizedGenerateReq]:
        """Tokenized, validated messages (ValueError names what is wrong)."""
        if inp.texts is not None:
            if self.tokenizer is None:
                raise ValueError("text needs a tokenizer (the server runs with skip_tokenizer_init): send input_ids")
            ids_list = [self.encode(t) for t in inp.texts]
        else:
            ids_list = inp.ids
        if self.tokenizer is None and any(p.stop for p in inp.params):
            raise ValueError("sampling_params.stop needs a tokenizer (skip_tokenizer_init is set)")
        msgs = []
        for i, ids in enumerate(ids_list):
            msg = TokenizedGenerateReq(inp.rids[i], list(ids), inp.params[i], inp.return_logprob[i],
                                       inp.logprob_start_len[i], inp.top_logprobs_num[i], inp.stream,
                                       kv_joins=inp.kv_joins, lora=inp.lora[i])
            validate_request(msg, self.limits)
            msgs.append(msg)
        return msgs

    def embedding_limits(self, encoder: bool) -> RuntimeLimits:
        """What an embedding request must fit: the --embedding-model's (encoder) or the main model's."""
        if encoder and self.encoder_limits is None:
            raise ValueError("this server has no embedding model (--embedding-model-path)")
        return self.encoder_limits if encoder else self.limits

    def embed_input(self, value, field: str = "input", encoder: bool = False, **options) -> EmbedInput:
        """`value` checked as an embedding call's input against the limits of the model that embeds it (the
        --embedding-model's when `encoder`); `options`: EmbedInput.of's dimensions, truncate, pooling."""
        return EmbedInput.of(value, self.embedding_limits(encoder), field, encoder=encoder, **options)

    async def embed(self, inp: EmbedInput) -> tuple[list[list[float]], list[int]]:
        """The inputs' embeddings (L2-normalized, in input order) and each one's tokens."""
        limits = self.embedding_limits(inp.encoder)
        tokenizer = self.encoder_tokenizer if inp.encoder else self.tokenizer
        if inp.texts is not None and tokenizer is None:
            raise ValueError("text needs a tokenizer (the server runs with skip_tokenizer_init): send token ids")
        long = inp.texts is not None and sum(len(t) for t in inp.texts) >= _THREAD_TOKENIZE_CHARS
        tokenize = lambda text, cut: self._embed_tokens(text, cut, inp.encoder)  # noqa: E731
        make = lambda: inp.messages(tokenize, limits.context_length)  # noqa: E731
        msgs = await asyncio.to_thread(make) if long else make()
        for m in msgs:
            validate_request(m, limits)
        states = self.submit(msgs, check_work=False)
        await self.first(self.results(states, stream=False, single=False))  # waits; refusals raise; aborts if cut
        for st in states:
            if st.embedding is None:
                raise RequestFailed(500, f"the request ended ({st.finish.to_json()}) without an embedding")
        vectors = [finish_vector(st.embedding, inp.dimensions) for st in states]
        return vectors, [len(m.input_ids) for m in msgs]

    def _embed_tokens(self, text: str, truncate_to: int | None, encoder: bool) -> list[int]:
        """A text's ids for an embedding; cut to `truncate_to` tokens where given (by the tokenizer where it
        can: an encoder's closing [SEP] stays)."""
        tokenizer = self.encoder_tokenizer if encoder else self.tokenizer
        most = self._encoder_max_chars if encoder else self._max_prompt_chars
        if len(text) > most:
            if truncate_to is None:
                context = self.embedding_limits(encoder).context_length
                raise ValueError(f"input has {len(text)} characters, more than fit the model's context length of "
                                 f"{context} tokens")
            text = text[:most]  # its first truncate_to tokens are in here
        if truncate_to is not None and hasattr(tokenizer, "num_special_tokens_to_add"):  # a transformers tokenizer
            return tokenizer.encode(text, truncation=True, max_length=truncate_to)
        ids = tokenizer.encode(text)
        return ids[:truncate_to] if truncate_to is not None else ids

    def submit(self, msgs: list[TokenizedGenerateReq], text_in_logprobs: bool = False,
               replica: int | None = None, check_work: bool = True) -> list[ReqState]:
        """Send one request's sequences (to `replica`, or the one `_pick_replica` chooses). Everything
        that can refuse them runs before anything is registered or sent, so a refused request leaves
        nothing behind."""
        self._check_alive()
        if self.draining:
            raise RequestFailed(503, "the server is shutting down")
        if check_work:  # embeddings generate nothing: their count has a limit of its own (embeddings.MAX_INPUTS)
            check_request_work(msgs, self.args, self.limits)
        cap = self.args.max_running_requests * self.args.dp_size + self.args.max_queued_requests
        if self.args.max_queued_requests >= 0 and len(self.states) + len(msgs) > cap:
            raise QueueFull(f"too many requests in flight ({len(self.states)}); the queue limit is "
                            f"{self.args.max_queued_requests} waiting beyond {self.args.max_running_requests} running")
        for m in msgs:
            if m.rid in self.states:
                raise ValueError(f"a request with rid {m.rid!r} is already running")
        group = msgs[0].rid if len(msgs) > 1 else ""  # the scheduler shares its slots fairly between groups
        try:
            frames = [self._enc.encode(msgspec.structs.replace(m, group=group) if group else m) for m in msgs]
        except (msgspec.EncodeError, UnicodeEncodeError, OverflowError) as e:
            raise ValueError(f"the request cannot be encoded: {e}") from None
        replica = self._pick_replica(msgs[0].kv_joins) if replica is None else replica
        states = [ReqState(m, text_in_logprobs) for m in msgs]
        for st, frame in zip(states, frames):
            st.replica = replica
            self.states[st.msg.rid] = st
            self._outs[replica].send(frame)
        return states

    def _pick_replica(self, kv_joins: list[str] | tuple[str, ...] = ()) -> int:
        """The replica holding the request's KV joins, else the one with the fewest requests in flight
        (ties in turn)."""
        for join in kv_joins or ():
            if join in self._join_replica:
                return self._join_replica[join]
        n = len(self._outs)
        if n == 1:
            return 0
        load = [0] * n
        for st in self.states.values():
            load[st.replica] += 1
        order = [(self._next_replica + i) % n for i in range(n)]
        best = min(order, key=lambda r: load[r])
        self._next_replica = (best + 1) % n
        return best

    @property
    def last_stats(self) -> SchedulerStats | None:
        """The latest stats of every replica, summed (the cache hit rate averaged)."""
        stats = list(self._replica_stats.values())
        if len(stats) <= 1:
            return stats[0] if stats else None
        return SchedulerStats(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                              sum(s.kv_used for s in stats), sum(s.kv_capacity for s in stats),
                              sum(s.cache_hit_rate for s in stats) / len(stats), sum(s.gen_throughput for s in stats))

    async def generate(self, inp: GenerateInput, replica: int | None = None) -> AsyncIterator[dict]:
        """tokenize + submit + results, for callers that take errors on the first iteration."""
        states = self.submit(await self.tokenize_async(inp), inp.return_text_in_logprobs, replica)
        async for item in self.results(states, inp.stream, inp.single):
            yield item

    async def results(self, states: list[ReqState], stream: bool, single: bool) -> AsyncIterator[dict]:
        """The final result (a dict, or a list in input order); with stream, a snapshot per update
        (batch items carry "index"). Aborts unfinished requests if the consumer stops early."""
        try:
            if stream:
                async for item in self._stream(states, single):
                    yield item
            else:
                await asyncio.gather(*(self._wait(st) for st in states))
                for st in states:
                    raise_if_rejected(st)
                results = [self.result(st) for st in states]
                yield results[0] if single else results
        finally:
            for st in states:
                if st.finish is None:
                    self.abort(st.msg.rid)

    async def first(self, gen: AsyncIterator[dict]):
        """The first item `generate`/`results` yields (the final result when not streaming)."""
        async for item in gen:
            await gen.aclose()
            return item

    async def _wait(self, st: ReqState) -> None:
        while st.finish is None:
            st.changed.clear()
            if st.finish is None:
                await st.changed.wait()

    async def _stream(self, states: list[ReqState], single: bool) -> AsyncIterator[dict]:
        pending = set(range(len(states)))
        while pending:
            waiters = {asyncio.ensure_future(states[i].changed.wait()): i for i in pending}
            done, rest = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for f in rest:
                f.cancel()
            for f in done:
                i = waiters[f]
                st = states[i]
                st.changed.clear()
                raise_if_rejected(st)
                snap = self.result(st, delta_logprobs=True)
                if not single:
                    snap["index"] = i
                yield snap
                if st.finish is not None:
                    pending.discard(i)

    def result(self, st: ReqState, delta_logprobs: bool = False) -> dict:
        return sglang_result(st, self.tokenizer, delta_logprobs)

    def abort(self, rid: str) -> None:
        if self.dead is None:
            st = self.states.get(rid)
            frame = self._enc.encode(AbortReq(rid))
            for replica in ([st.replica] if st is not None else range(len(self._outs))):
                self._outs[replica].send(frame)

    async def join_kv(self, fork_text: str, branch_texts: list[str], kv_joins: list[str] | None = None) -> dict:
        """concate_and_append: the KV of fork_text + branch_texts[0] + branch_texts[1] + ... built
        from each branch's own KV (no forward over what the branches computed). Each fork_text +
        branch text is prefilled first (mostly cache hits). Returns {"join_id", "input_ids",
        "reused"}: later requests that name join_id in kv_joins reuse the joined KV; or
        {"join_id": None, "reason"} where it cannot (the caller then sends the joined text as usual)."""
        joins = check_kv_joins(kv_joins)
        if not isinstance(fork_text, str) or not fork_text:
            raise ValueError("fork_text must be a non-empty string")
        if (not isinstance(branch_texts, list) or not 2 <= len(branch_texts) <= 64
                or not all(isinstance(t, str) for t in branch_texts)):
            raise ValueError("branch_texts must be a list of 2 to 64 strings")
        if self.tokenizer is None:
            raise ValueError("join_kv needs a tokenizer (the server runs with skip_tokenizer_init)")
        def encode_all() -> tuple[list[int], list[list[int]]]:
            return self.encode(fork_text, "fork_text"), [self.encode(fork_text + t, "branch_texts") for t in branch_texts]

        long = len(fork_text) * len(branch_texts) >= _THREAD_TOKENIZE_CHARS
        fork, parts = await asyncio.to_thread(encode_all) if long else encode_all()
        if any(p[: len(fork)] != fork for p in parts):  # a branch's first token merged with the fork's last
            return {"join_id": None, "reason": "a branch text changes how the fork text tokenizes"}
        replica = self._pick_replica(joins)  # the branches' KV and the join live in one replica
        await self.first(self.generate(GenerateInput(input_ids=parts, sampling_params={"max_new_tokens": 0},
                                                     kv_joins=joins), replica))
        reply = await self._control(JoinKVReq(uuid.uuid4().hex, parts, len(fork), joins), replica)
        if not reply.ok:
            return {"join_id": None, "reason": reply.info.get("reason", "")}
        self._join_replica[reply.info["join_id"]] = replica
        return dict(reply.info)

    async def load_lora(self, name: str, path: str) -> tuple[list[str], str]:
        """Register a LoRA adapter on every replica: (the adapters served, "" or why not)."""
        return await self._lora_control(lambda: LoadLoRAReq(uuid.uuid4().hex, name, path))

    async def unload_lora(self, name: str) -> tuple[list[str], str]:
        return await self._lora_control(lambda: UnloadLoRAReq(uuid.uuid4().hex, name))

    async def _lora_control(self, make) -> tuple[list[str], str]:
        replies = await self._control_all(make)
        errors = [r.info["error"] for r in replies if not r.ok]
        adapters = next((r.info["adapters"] for r in replies if r.ok), sorted(self.lora_adapters))
        self.lora_adapters = set(adapters)
        return sorted(self.lora_adapters), errors[0] if errors else ""

    async def flush_cache(self) -> bool:
        replies = await self._control_all(lambda: FlushCacheReq(uuid.uuid4().hex))
        return all(r.ok for r in replies)

    async def server_info(self) -> dict:
        """The scheduler's info; with several replicas, their counts summed, the rest replica 0's, and each
        replica's own under "replicas"."""
        infos = [dict(r.info) for r in await self._control_all(lambda: ServerInfoReq(uuid.uuid4().hex))]
        if len(infos) == 1:
            return infos[0]
        total = dict(infos[0])
        for key in infos[0]:
            if all(isinstance(i.get(key), int) and not isinstance(i.get(key), bool) for i in infos):
                total[key] = sum(i[key] for i in infos)
        total["replicas"] = infos
        return total

    async def _control_all(self, make) -> list[ControlReply]:
        return list(await asyncio.gather(*(self._control(make(), r) for r in range(len(self._outs)))))

    async def _control(self, msg, replica: int = 0) -> ControlReply:
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._replies[msg.req_id] = fut
        self._outs[replica].send(self._enc.encode(msg))
        return await fut

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise RuntimeDead(self.dead)

    # ---- background tasks -------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            msg = self._dec.decode(await self._in.recv())
            if isinstance(msg, BatchStrOut):
                now = time.perf_counter()
                for so in msg.outs:
                    st = self.states.get(so.out.rid)
                    if st is None:
                        continue
                    st.apply(so, now)
                    if so.out.finish is not None and so.out.finish.status == 500:
                        self.abort(so.out.rid)  # the detokenizer failed it: the scheduler may still be generating
                    if self.metrics is not None:
                        self.metrics.on_output(st, so.out, now)
                    if st.finish is not None:
                        del self.states[so.out.rid]
                        if self.metrics is not None:
                            self.metrics.on_finish(st, now)
            elif isinstance(msg, ControlReply):
                fut = self._replies.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, SchedulerStats):
                self._replica_stats[msg.replica] = msg
                if self.metrics is not None:
                    self.metrics.on_stats(self.last_stats)

    async def _watch_loop(self) -> None:
        while self.dead is None:
            await asyncio.sleep(_WATCH_INTERVAL)
            dead = self.rt.dead()
            if dead:
                self._fail(f"runtime process died: {', '.join(dead)}")

    def end_all(self, why: str) -> None:
        """End every in-flight request with a 503 (shutdown drain ran out of time); streams get an
        error event."""
        for rid, st in list(self.states.items()):
            st.finish = FinishReason("abort", message=why, status=503)
            st.changed.set()
            self.abort(rid)
        self.states.clear()

    def _fail(self, why: str) -> None:
        logger.error("%s; failing %d in-flight requests", why, len(self.states))
        self.dead = why
        for st in list(self.states.values()):
            st.finish = FinishReason("abort", message=why, status=503)
            st.changed.set()
        self.states.clear()
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(RuntimeDead(why))
        self._replies.clear()
        if self.on_death is not None:
            self.on_death(why)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._in.close(0)
        for sock in self._outs:
            sock.close(0)
        self.ctx.term()


def _max_prompt_chars(tokenizer, context_length: int) -> int:
    """No tokenization of a longer text fits the context: every token is at most this many characters."""
    if tokenizer is None:
        return 1 << 62
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return context_length * max(longest, 1) + 16
