"""What the HTTP routes share: the server's state, errors with an OpenAI-style body, reading a JSON body,
waiting on a result while watching for a client that hangs up, and server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import AsyncIterator, Collection

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from plait.runtime.client import QueueFull, RequestFailed, RuntimeClient, RuntimeDead
from plait.runtime.client.embeddings import encoder_names, uses_encoder
from plait.runtime.entrypoints.http_guard import error_body, parse_json_body, shown
from plait.runtime.launch.launcher import RuntimeProcesses
from plait.runtime.parsers import ReasoningParser, ToolCallParser
from plait.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

_DISCONNECT_POLL = 0.5
_THREAD_PARSE_BYTES = 256 * 1024


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_


def error_response(status: int, message: str, type_: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_), status_code=status)


def ollama_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def served_model_name(args: ServerArgs) -> str:
    return args.served_model_name or os.path.basename(args.model_path.rstrip("/"))


class ServerState:
    """What the endpoints share: the args, the runtime processes, the client (made at start-up)."""

    def __init__(self, args: ServerArgs, runtime: RuntimeProcesses, metrics=None):
        self.args = args
        self.runtime = runtime
        self.metrics = metrics
        self.client: RuntimeClient | None = None
        self.tool_parser: ToolCallParser | None = None  # the model family's formats (set with the client)
        self.reasoning_parser: ReasoningParser | None = None
        self.model_name = served_model_name(args)
        # names an OpenAI request may give for the one model served (others get a 404, as in vLLM)
        self.model_aliases = args.model_names()
        # the --embedding-model's name and the names a request may give it (none: there is none)
        self.encoder_aliases = encoder_names(args.embedding_model_path)
        self.encoder_name = (os.path.basename(args.embedding_model_path.rstrip("/")) if args.embedding_model_path
                             else None)
        self.on_death = lambda why: None  # replaced by launch_server to stop the process
        self.shutting_down = False
        self.responses = None  # the Responses API's stored responses (responses_api._Store, made on first use)


def server_state(request: Request) -> ServerState:
    """The routes' dependency: the state of the app serving `request`."""
    return request.app.state.plait


def refuse_unknown(route: str, unknown: Collection[str]) -> None:
    """A 400 naming a native route's unknown fields, if any."""
    if unknown:
        raise HTTPError(400, f"unknown field(s) in {route}: {', '.join(shown(k) for k in sorted(unknown))}")


async def read_json(request: Request) -> dict:
    """The body as a checked JSON object (http_guard.parse_json_body). Its size is bounded by the
    Guard middleware, chunked bodies included."""
    raw = b"".join([chunk async for chunk in request.stream()])
    if len(raw) > _THREAD_PARSE_BYTES:  # a big body is parsed off the event loop
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


async def validated_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The body as `model`, strictly (no bool for an int, no string for a number); a 400 names each field."""
    body = await read_json(request)
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as e:
        raise HTTPError(400, validation_message(e.errors(include_url=False))) from None


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors as one message naming each field ("messages.0.role: Input should be ...")."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


async def first_or_disconnect(request: Request, client: RuntimeClient, gen: AsyncIterator):
    """The generator's first item; a client that hangs up cancels it (which aborts its requests).
    Requests cut short by a dead runtime are a 503."""
    task = asyncio.ensure_future(client.first(gen))
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL)
        if done:
            if client.dead is not None:
                raise RuntimeDead(client.dead)
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            await gen.aclose()
            raise HTTPError(499, "client disconnected")


def constrained(msgs) -> bool:
    """Whether some request carries a grammar (whose compile may refuse it)."""
    return any(m.sampling_params.regex is not None or m.sampling_params.json_schema is not None
               or m.sampling_params.ebnf is not None for m in msgs)


async def started(request: Request, client: RuntimeClient, gen: AsyncIterator) -> AsyncIterator:
    """`gen` once its first item is here, that item included: a refusal before it (a grammar no backend can
    enforce, a dead runtime) is raised now and answered with its HTTP status, not sent inside a 200 stream."""
    it = gen.__aiter__()
    task = asyncio.ensure_future(it.__anext__())
    while not task.done():
        await asyncio.wait({task}, timeout=_DISCONNECT_POLL)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, StopAsyncIteration):
                pass
            await gen.aclose()  # its requests are aborted
            raise HTTPError(499, "client disconnected")
    try:
        first = task.result()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await gen.aclose()
        raise

    async def chained():
        try:
            if first is not None:
                yield first
            async for item in it:
                yield item
        finally:
            await gen.aclose()  # the stream's end or its client's leaving aborts what is unfinished

    return chained()


async def sse(request: Request, gen: AsyncIterator[dict], render=None) -> AsyncIterator[bytes]:
    """Server-sent events, `data: {...}` per item and `data: [DONE]` at the end. An error after
    the stream started is sent as a final error event."""
    try:
        async for item in gen:
            payload = render(item) if render else [item]
            for p in payload:
                yield b"data: " + json.dumps(p, ensure_ascii=False).encode() + b"\n\n"
    except (ValueError, QueueFull, RuntimeDead, RequestFailed) as e:
        code = (400 if isinstance(e, ValueError) else 429 if isinstance(e, QueueFull)
                else e.status if isinstance(e, RequestFailed) else 503)
        yield b"data: " + json.dumps(error_body(code, str(e))).encode() + b"\n\n"
    except Exception as e:  # noqa: BLE001 - a bug rendering this stream ends it with an error event
        logger.error("stream failed", exc_info=e)
        yield b"data: " + json.dumps(error_body(500, f"internal error: {type(e).__name__}: {e}")).encode() + b"\n\n"
    finally:
        await gen.aclose()
    yield b"data: [DONE]\n\n"


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plait")
    except PackageNotFoundError:
        return "0"


def embedding_model(state: ServerState, model: str | None) -> bool:
    """Whether a request naming `model` is embedded by the --embedding-model (else by the main model); a 404 for
    a name neither has."""
    try:
        return uses_encoder(model, state.encoder_aliases, state.model_aliases)
    except LookupError:
        served = ", ".join(f"`{n}`" for n in [state.model_name, state.encoder_name] if n)
        raise HTTPError(404, f"The model `{shown(model)}` does not exist (this server serves {served}).") from None
