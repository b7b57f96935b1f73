"""Engine: the Python API of the runtime (`plait.Engine`), in-process and synchronous.

It starts the runtime's processes (scheduler, detokenizer) and is a client of them through the
same `RuntimeClient` the HTTP server uses, run on a private event loop thread. Results have the
shape of SGLang's /generate response.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator, Iterator

from plait.runtime.launch.launcher import launch_runtime
from plait.runtime.server_args import ServerArgs
from plait.runtime.client import GenerateInput, RuntimeClient
from plait.runtime.client.embeddings import encoder_names, native_result, uses_encoder

logger = logging.getLogger(__name__)


class Engine:
    """`Engine(model_path=None, **server_args)`; `generate(...)`, `async_generate(...)`, `shutdown()`."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        args = ServerArgs(model_path=model_path, **kwargs).resolved()
        logging.basicConfig(level=args.log_level.upper(), format="[plait %(asctime)s] %(message)s")
        self.args = args
        self.runtime = launch_runtime(args)
        self.tokenizer = self.runtime.tokenizer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="plait-client", daemon=True)
        self._thread.start()
        self.client: RuntimeClient = self._run(self._make_client())

    async def _make_client(self) -> RuntimeClient:
        return RuntimeClient(self.runtime)

    # ---- public API -------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] = -1, top_logprobs_num: int | list[int] = 0,
                 stream: bool = False, return_text_in_logprobs: bool = False, rid: str | list[str] | None = None,
                 kv_joins: list[str] | None = None, lora_path: str | list[str | None] | None = None):
        """A dict (single request), a list of dicts (batch, in input order), or with stream=True an
        iterator of snapshots (cumulative text; batch snapshots carry "index"). kv_joins: join ids
        from join_kv whose KV the request may reuse; lora_path: the LoRA adapter (by name) of each prompt."""
        inp = GenerateInput(prompt, input_ids, sampling_params, return_logprob, logprob_start_len, top_logprobs_num,
                            return_text_in_logprobs, stream, rid, kv_joins, lora_path)
        if stream:
            return self._stream(inp)
        return self._checked(self._run(self.client.first(self.client.generate(inp))))

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None,
                             return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] = -1,
                             top_logprobs_num: int | list[int] = 0, stream: bool = False,
                             return_text_in_logprobs: bool = False, rid: str | list[str] | None = None,
                             kv_joins: list[str] | None = None, lora_path: str | list[str | None] | None = None):
        """Async variant (any event loop); with stream=True returns an async iterator of snapshots."""
        inp = GenerateInput(prompt, input_ids, sampling_params, return_logprob, logprob_start_len, top_logprobs_num,
                            return_text_in_logprobs, stream, rid, kv_joins, lora_path)
        if stream:
            return self._astream(inp)
        coro = self.client.first(self.client.generate(inp))
        return self._checked(await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop)))

    def embed(self, input: str | list[str] | list[int] | list[list[int]], dimensions: int | None = None,
              truncate: bool = False, pooling: str | None = None, model: str | None = None) -> list[list[float]]:
        """The embeddings of the inputs (texts or token id lists; a single string is one input), L2-normalized,
        in input order. `pooling`: "last", "mean" or "cls" (default: the model's); `truncate`: cut inputs longer
        than the context instead of refusing them; `model`: the main model's name or the --embedding-model's
        (default: the embedding model where there is one)."""
        encoder = self._embedder(model)
        inp = self.client.embed_input(input, encoder=encoder, dimensions=dimensions, truncate=truncate,
                                      pooling=pooling)
        return self._checked(self._run(self.client.embed(inp)))[0]

    def _embedder(self, model: str | None) -> bool:
        args = self.args
        try:
            return uses_encoder(model, encoder_names(args.embedding_model_path), args.model_names())
        except LookupError:
            raise ValueError(f"model {model!r} is neither the main model nor the embedding model") from None

    def encode(self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
               dimensions: int | None = None) -> dict | list[dict]:
        """SGLang's Engine.encode: {"embedding", "meta_info"} for one prompt, a list of them for a batch."""
        value = prompt if prompt is not None else input_ids
        encoder = self._embedder(None)
        inp = self.client.embed_input(value, "prompt" if prompt is not None else "input_ids", encoder,
                                      dimensions=dimensions)
        return native_result(value, *self._checked(self._run(self.client.embed(inp))))

    def abort(self, rid: str) -> None:
        self._loop.call_soon_threadsafe(self.client.abort, rid)

    def join_kv(self, fork_text: str, branch_texts: list[str], kv_joins: list[str] | None = None) -> dict:
        """concate_and_append: the KV of fork_text + all branch texts, built from each branch's own
        KV (RuntimeClient.join_kv). Name the returned join_id in later calls' kv_joins."""
        return self._checked(self._run(self.client.join_kv(fork_text, branch_texts, kv_joins)))

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> list[str]:
        """Register a LoRA adapter (SGLang's name); returns the adapters served. ValueError: why not."""
        adapters, error = self._run(self.client.load_lora(lora_name, lora_path))
        if error:
            raise ValueError(error)
        return adapters

    def unload_lora_adapter(self, lora_name: str) -> list[str]:
        """Unregister a LoRA adapter; the requests running with it finish with it."""
        adapters, error = self._run(self.client.unload_lora(lora_name))
        if error:
            raise ValueError(error)
        return adapters

    def flush_cache(self) -> bool:
        return self._run(self.client.flush_cache())

    def get_server_info(self) -> dict:
        info = {k: getattr(self.args, k) for k in self.args.__dataclass_fields__}
        return {**info, **self._run(self.client.server_info())}

    def shutdown(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._run(self.client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self.runtime.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals --------------------------------------------------------------------
    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _checked(self, result):
        if self.client.dead is not None:
            raise RuntimeError(f"plait engine stopped: {self.client.dead}")
        return result

    def _stream(self, inp: GenerateInput) -> Iterator[dict]:
        gen = self.client.generate(inp)
        try:
            while True:
                try:
                    yield self._checked(self._run(_next(gen)))
                except StopAsyncIteration:
                    return
        finally:  # an abandoned stream aborts its requests
            self._run(_close(gen))

    async def _astream(self, inp: GenerateInput) -> AsyncIterator[dict]:
        gen = self.client.generate(inp)
        try:
            while True:
                try:
                    item = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_next(gen), self._loop))
                except StopAsyncIteration:
                    return
                yield self._checked(item)
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_close(gen), self._loop))


async def _next(gen: AsyncIterator[dict]) -> dict:
    return await gen.__anext__()


async def _close(gen) -> None:
    await gen.aclose()
