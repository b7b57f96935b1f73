"""The scheduler process: owns the model runner, KV pools and radix cache; runs the loop.

    receive (drain the inbox) -> scheduler.step() -> send each step's outputs to the detokenizer

With --embedding-model-path, a second runner and scheduler (an encoder's: embeddings only) live here too; the
requests that name it (EmbedSpec.encoder) go to it, and each loop steps both.

It blocks on its inbox only when idle, so queued messages never delay a running batch by more
than one step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

import msgspec
import zmq

from plait.runtime.ipc.messages import (
    AbortReq,
    BatchTokenOut,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    JoinKVReq,
    LoadLoRAReq,
    SchedulerStats,
    ServerInfoReq,
    TokenizedGenerateReq,
    TokenOut,
    ToScheduler,
    UnloadLoRAReq,
)
from plait.runtime.distributed.place import RankPlace, join
from plait.runtime.ipc.channels import Addresses, BadMessage, Receiver, Sender
from plait.runtime.lifetime import die_with_parent, parent_alive
from plait.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

_STATS_INTERVAL = 1.0
# glibc keeps freed heap pages: batches of ever new shapes (each prefill chunk's row count) fragment the
# heap (a loop of matmuls over 490 row counts: 2.8 GB resident, 0.8 GB trimmed now and then; README:
# Reliability). Handing free pages back every 30 s costs a few ms.
_TRIM_INTERVAL = 30.0


def run_scheduler_process(args: ServerArgs, addrs: Addresses, place: RankPlace, ready) -> None:
    """Process entry point: build the runtime (rank 0 of its replica's group), report readiness (or the
    error) on `ready` (a proc_main.ReadyPipe), loop."""
    die_with_parent(addrs.root)
    ppid = os.getppid()
    replica = f" dp {place.replica}" if args.dp_size > 1 else ""
    logging.basicConfig(level=args.log_level.upper(), format=f"[plait scheduler{replica} %(asctime)s] %(message)s")
    with ready.starting() as reply:
        from plait.runtime.model_executor.model_runner import ModelRunner
        from plait.runtime.scheduler.scheduler import Scheduler

        ctx = zmq.Context()
        inbox = Receiver(ctx, addrs.scheduler_of(place.replica), ToScheduler)
        out = Sender(ctx, addrs.detokenizer)
        runner = ModelRunner(args, group=join(place))
        emit = lambda outs: out.send(BatchTokenOut(outs))  # noqa: E731
        scheduler = Scheduler(args, runner, emit)
        reply["limits"] = msgspec.to_builtins(scheduler.limits)
        reply["lora_adapters"] = runner.lora.names() if runner.lora is not None else []
        encoder = None
        if args.embedding_model_path:
            encoder_args = args.encoder_args()
            encoder = Scheduler(encoder_args, ModelRunner(encoder_args), emit)
            reply["encoder_limits"] = msgspec.to_builtins(encoder.limits)
    try:
        _Loop(scheduler, runner, inbox, out, ppid, place.replica, encoder).run()
        runner.stop()  # orphaned: the other ranks stop too (a failed collective skips this and fails them)
        runner.group.close()
    finally:
        scheduler.close()
        if encoder is not None:
            encoder.close()


def _malloc_trim():
    """glibc's malloc_trim, or None (another libc)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class _Loop:
    def __init__(self, scheduler, runner, inbox: Receiver, out: Sender, ppid: int, replica: int = 0, encoder=None):
        self.scheduler = scheduler
        self.encoder = encoder  # the --embedding-model's scheduler, or None
        self.runner = runner
        self.replica = replica
        self.inbox = inbox
        self.out = out
        self.ppid = ppid
        self._last_stats = time.perf_counter()
        self._last_trim = time.perf_counter()
        self._tokens_since = 0
        self._trim = _malloc_trim()

    def run(self) -> None:
        while True:
            if self.idle:
                self._send_stats(force=False)
                while not self.inbox.poll(1000):  # idle: wake once a second to notice an orphaning
                    if not parent_alive(self.ppid):
                        return
                    self.runner.tick()  # and tell the other ranks, if any, that rank 0 lives
            while (msg := self._recv()) is not None:
                self._handle(msg)
            before = self.scheduler.tokens_generated
            self.scheduler.step()
            if self.encoder is not None:
                self.encoder.step()
            self._tokens_since += self.scheduler.tokens_generated - before
            self._send_stats(force=self.idle)  # once more when it goes idle
            if self._trim is not None and time.perf_counter() - self._last_trim > _TRIM_INTERVAL:
                self._trim(0)
                self._last_trim = time.perf_counter()

    @property
    def idle(self) -> bool:
        return self.scheduler.idle and (self.encoder is None or self.encoder.idle)

    def _recv(self):
        """The next message, or None. A frame that does not decode fails its request (if it names
        one) instead of the process: clients validate first, this is the last line of defence."""
        while True:
            try:
                return self.inbox.recv(block=False)
            except BadMessage as e:
                logger.error("dropped a message that does not decode: %s", e)
                if e.rid is not None:
                    self._refuse(e.rid, 0, f"the request does not decode: {e}", 400)

    def _refuse(self, rid: str, prompt_tokens: int, message: str, status: int) -> None:
        self.out.send(BatchTokenOut([TokenOut(rid, [], FinishReason("abort", message=message, status=status),
                                              prompt_tokens, 0, 0)]))

    def _handle(self, msg) -> None:
        s = self.scheduler
        if isinstance(msg, TokenizedGenerateReq):
            if msg.embed is not None and msg.embed.encoder:
                if self.encoder is None:
                    self._refuse(msg.rid, len(msg.input_ids), "this server has no embedding model", 400)
                    return
                s = self.encoder
            try:
                s.add_request(msg)
            except ValueError as e:  # the client validates first; this is the last line of defence
                self._refuse(msg.rid, len(msg.input_ids), str(e), 400)
            except Exception as e:  # noqa: BLE001 - a bug admitting one request fails that request
                logger.exception("request %s failed on arrival", msg.rid)
                self._refuse(msg.rid, len(msg.input_ids), f"internal error on arrival: {type(e).__name__}: {e}", 500)
        elif isinstance(msg, AbortReq):
            s.abort(msg)
            if self.encoder is not None:
                self.encoder.abort(msg)
        elif isinstance(msg, FlushCacheReq):
            self.out.send(ControlReply(msg.req_id, s.flush_cache()))
        elif isinstance(msg, ServerInfoReq):
            self.out.send(ControlReply(msg.req_id, True, s.stats(check=True)))
        elif isinstance(msg, LoadLoRAReq):
            info = s.load_lora(msg.name, msg.path)
            self.out.send(ControlReply(msg.req_id, "error" not in info, info))
        elif isinstance(msg, UnloadLoRAReq):
            info = s.unload_lora(msg.name)
            self.out.send(ControlReply(msg.req_id, "error" not in info, info))
        elif isinstance(msg, JoinKVReq):
            try:
                info = s.join_kv(msg)
            except Exception as e:  # noqa: BLE001 - a bug in one join fails that join, not the server
                logger.exception("join %s failed", msg.req_id)
                info = {"reason": f"internal error: {type(e).__name__}: {e}"}
            self.out.send(ControlReply(msg.req_id, "join_id" in info, info))

    def _send_stats(self, force: bool) -> None:
        now = time.perf_counter()
        elapsed = now - self._last_stats
        if not force and elapsed < _STATS_INTERVAL:
            return
        st = self.scheduler.stats()
        self.out.send(SchedulerStats(
            num_running=st["num_running"], num_waiting=st["num_waiting"],
            kv_used=st["kv_capacity"] - st["kv_free"], kv_capacity=st["kv_capacity"],
            cache_hit_rate=st["cache_hit_rate"],
            gen_throughput=self._tokens_since / elapsed if elapsed > 0 else 0.0, replica=self.replica,
        ))
        self._last_stats, self._tokens_since = now, 0
