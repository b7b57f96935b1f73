"""Engine: the Python API of the runtime (`plait.Engine`).

The scheduler runs on its own thread (one process for now); callers submit tokenized requests
through a queue and receive TokenOut messages back, detokenized per request. Results have the
shape of SGLang's /generate response.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import Any, AsyncIterator, Iterator

from plait.runtime.detokenizer import IncrementalDecoder
from plait.runtime.io_struct import AbortReq, FinishReason, TokenizedGenerateReq, TokenOut
from plait.runtime.model_runner import ModelRunner
from plait.runtime.sampling import SamplingParams
from plait.runtime.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


class _ReqState:
    """Everything the caller side knows about one request."""

    def __init__(self, msg: TokenizedGenerateReq, tokenizer):
        p = msg.sampling_params
        self.msg = msg
        self.decoder = IncrementalDecoder(tokenizer, p.skip_special_tokens, p.stop, p.no_stop_trim,
                                          p.spaces_between_special_tokens)
        self.finish: FinishReason | None = None
        self.meta: dict[str, Any] = {}
        self.output_logprobs: list = []
        self.output_top: list = []
        self.input_logprobs: list = []
        self.input_top: list = []
        self.start = time.perf_counter()
        self.done = threading.Event()
        self.events: queue.Queue[dict] = queue.Queue()  # streaming snapshots
        self.async_sink: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None

    def apply(self, out: TokenOut) -> None:
        self.decoder.feed(out.new_ids)
        self.output_logprobs += out.output_logprobs
        self.output_top += out.output_top_logprobs
        self.input_logprobs += out.input_logprobs
        self.input_top += out.input_top_logprobs
        self.meta = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                     "cached_tokens": out.cached_tokens}
        if out.finish is not None:
            self.finish = out.finish
            self.decoder.finish()
        if self.msg.stream:
            snapshot = self.result()
            self.events.put(snapshot)
            if self.async_sink is not None:
                loop, q = self.async_sink
                loop.call_soon_threadsafe(q.put_nowait, snapshot)
        if self.finish is not None:
            self.done.set()

    def result(self) -> dict:
        meta: dict[str, Any] = {
            "id": self.msg.rid,
            "finish_reason": self.finish.to_json() if self.finish else None,
            **self.meta,
            "e2e_latency": time.perf_counter() - self.start,
        }
        if self.msg.return_logprob:
            meta["input_token_logprobs"] = [[lp, tid, None] for lp, tid in self.input_logprobs]
            meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in self.output_logprobs]
            if self.msg.top_logprobs_num:
                meta["input_top_logprobs"] = [None if t is None else [[lp, tid, None] for lp, tid in t]
                                              for t in self.input_top]
                meta["output_top_logprobs"] = [[[lp, tid, None] for lp, tid in t] for t in self.output_top]
        return {"text": self.decoder.text, "output_ids": list(self.decoder.ids), "meta_info": meta}


class Engine:
    """`Engine(model_path=None, **server_args)`; `generate(...)`, `async_generate(...)`, `shutdown()`."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        args = ServerArgs(model_path=model_path, **kwargs).resolved()
        logging.basicConfig(level=args.log_level.upper(), format="[plait %(asctime)s] %(message)s")
        self.args = args
        self.runner = ModelRunner(args)
        self.tokenizer = self.runner.tokenizer
        self.scheduler = Scheduler(args, self.runner, self._on_outputs)
        self._inbox: queue.Queue = queue.Queue()
        self._states: dict[str, _ReqState] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="plait-scheduler", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0, stream: bool = False):
        """Returns a dict (single request), a list of dicts (batch, in input order), or with
        stream=True an iterator of cumulative snapshots of a single request."""
        msgs, single = self._build(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                   top_logprobs_num, stream)
        states = self._submit(msgs)
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            return self._stream(states[0])
        for st in states:
            st.done.wait()
        self._raise_if_dead()
        results = [st.result() for st in states]
        return results[0] if single else results

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                             logprob_start_len: int = -1, top_logprobs_num: int = 0, stream: bool = False):
        """Async variant; with stream=True returns an async iterator of snapshots."""
        msgs, single = self._build(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                   top_logprobs_num, stream)
        if stream and not single:
            raise ValueError("stream=True takes a single prompt")
        loop = asyncio.get_running_loop()
        sinks = [asyncio.Queue() for _ in msgs]
        states = self._submit(msgs, [(loop, q) for q in sinks] if stream else None)
        if stream:
            return self._astream(states[0], sinks[0])
        await asyncio.gather(*(loop.run_in_executor(None, st.done.wait) for st in states))
        self._raise_if_dead()
        results = [st.result() for st in states]
        return results[0] if single else results

    def abort(self, rid: str) -> None:
        self._inbox.put(AbortReq(rid))

    def flush_cache(self) -> bool:
        done = threading.Event()
        box: list[bool] = []
        self._inbox.put(("flush", box, done))
        done.wait()
        return box[0]

    def get_server_info(self) -> dict:
        return {**{k: getattr(self.args, k) for k in self.args.__dataclass_fields__}, **self.scheduler.stats()}

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals --------------------------------------------------------------------
    def _build(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
               stream) -> tuple[list[TokenizedGenerateReq], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("prompt text needs a tokenizer (started with skip_tokenizer_init): give input_ids")
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = not input_ids or isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
            if not all(isinstance(t, int) for ids in ids_list for t in ids):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(ids_list)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids_list)
        if self.tokenizer is None and any(p.stop for p in params):
            raise ValueError("sampling_params.stop needs a tokenizer (started with skip_tokenizer_init)")
        if logprob_start_len < -1:
            raise ValueError("logprob_start_len must be >= -1")
        msgs = [TokenizedGenerateReq(uuid.uuid4().hex, ids, p, return_logprob, logprob_start_len, top_logprobs_num,
                                     stream) for ids, p in zip(ids_list, params)]
        for m in msgs:
            self.scheduler.validate(m)
        return msgs, single

    def _submit(self, msgs: list[TokenizedGenerateReq], sinks=None) -> list[_ReqState]:
        self._raise_if_dead()
        states = []
        with self._lock:
            for i, m in enumerate(msgs):
                st = _ReqState(m, self.tokenizer)
                if sinks is not None:
                    st.async_sink = sinks[i]
                self._states[m.rid] = st
                states.append(st)
        for m in msgs:
            self._inbox.put(m)
        return states

    def _stream(self, st: _ReqState) -> Iterator[dict]:
        while True:
            snap = st.events.get()
            yield snap
            if snap["meta_info"]["finish_reason"] is not None:
                return

    async def _astream(self, st: _ReqState, q: asyncio.Queue) -> AsyncIterator[dict]:
        while True:
            snap = await q.get()
            yield snap
            if snap["meta_info"]["finish_reason"] is not None:
                return

    def _on_outputs(self, outs: list[TokenOut]) -> None:
        for out in outs:
            with self._lock:
                st = self._states.get(out.rid)
                if out.finish is not None:
                    self._states.pop(out.rid, None)
            if st is not None:
                st.apply(out)

    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                block = self.scheduler.idle
                while True:
                    try:
                        item = self._inbox.get(block=block, timeout=None)
                    except queue.Empty:
                        break
                    block = False
                    if item is None:
                        return
                    self._handle(item)
                self.scheduler.step()
        except BaseException as e:  # fail every waiting caller loudly rather than hang them
            logger.exception("scheduler loop died")
            self._error = e
            with self._lock:
                states, self._states = list(self._states.values()), {}
            for st in states:
                st.apply(TokenOut(st.msg.rid, [], FinishReason("abort", message=f"engine error: {e}"), 0, 0, 0))

    def _handle(self, item) -> None:
        if isinstance(item, TokenizedGenerateReq):
            try:
                self.scheduler.add_request(item)
            except ValueError as e:
                self._on_outputs([TokenOut(item.rid, [], FinishReason("abort", message=str(e)),
                                           len(item.input_ids), 0, 0)])
        elif isinstance(item, AbortReq):
            self.scheduler.abort(item)
        elif isinstance(item, tuple) and item[0] == "flush":
            _, box, done = item
            box.append(self.scheduler.flush_cache())
            done.set()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"plait engine stopped after an error: {self._error}") from self._error
