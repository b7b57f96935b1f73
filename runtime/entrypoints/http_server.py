"""The HTTP server: FastAPI on uvicorn, one client of the runtime processes.

SGLang's native API (/generate, /get_model_info, /server_info, /flush_cache, /health, ...) and,
from `openai_api`, the OpenAI API. Errors are 4xx/5xx with an OpenAI-style body
`{"error": {"message", "type", "code"}}`; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Collection

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plait.runtime.entrypoints.connections import ConnectionLimits, guarded_protocol
from plait.runtime.entrypoints.http_guard import (BodyError, Guard, default_allowed_hosts, error_body, parse_json_body,
                                                 shown)
from plait.runtime.launch.launcher import RuntimeProcesses
from plait.runtime.ipc.limits import MAX_JOIN_ID_CHARS, MAX_KV_JOINS
from plait.runtime.server_args import ServerArgs
from plait.runtime.parsers import ReasoningParser, ToolCallParser, reasoning_parser, tool_parser
from plait.runtime.client.runtime_client import GenerateInput, QueueFull, RequestFailed, RuntimeClient, RuntimeDead

logger = logging.getLogger(__name__)

_DISCONNECT_POLL = 0.5
_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                  "return_text_in_logprobs", "stream", "rid", "kv_joins"}
# fields of SGLang's GenerateReqInput that clients such as sglang-router always send: accepted at the value that
# asks for nothing plait lacks (None: any value of that type; logging switches change nothing here)
_SGLANG_NOOP_KEYS: dict[str, tuple[type, object]] = {
    "log_metrics": (bool, None), "no_logs": (bool, None), "background": (bool, False),
    "return_bytes": (bool, False), "return_entropy": (bool, False), "return_hidden_states": (bool, False),
}


def _check_generate_keys(body: dict) -> None:
    unknown = []
    for k, v in body.items():
        if k in _GENERATE_KEYS or v is None:
            continue
        if k in _SGLANG_NOOP_KEYS:
            kind, only = _SGLANG_NOOP_KEYS[k]
            if not isinstance(v, kind):
                raise HTTPError(400, f"{k} must be a {kind.__name__}, got {type(v).__name__}")
            if only is not None and v != only:
                raise HTTPError(400, f"{k}={json.dumps(v)} is not supported by plait")
            continue
        unknown.append(k)
    refuse_unknown("/generate", unknown)


def refuse_unknown(route: str, unknown: Collection[str]) -> None:
    """A 400 naming a native route's unknown fields, if any."""
    if unknown:
        raise HTTPError(400, f"unknown field(s) in {route}: {', '.join(shown(k) for k in sorted(unknown))}")


_THREAD_PARSE_BYTES = 256 * 1024
# a runtime that died keeps answering 503 (on /health too) this long before the server exits
_DEATH_GRACE = 2.0


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_


def error_response(status: int, message: str, type_: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_), status_code=status)


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
        base = os.path.basename(args.model_path.rstrip("/"))
        self.model_aliases = {self.model_name, "default", args.model_path, base, os.path.splitext(base)[0]}
        self.on_death = lambda why: None  # replaced by launch_server to stop the process
        self.shutting_down = False


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.client = RuntimeClient(state.runtime, state.metrics, on_death=lambda why: state.on_death(why))
        template = getattr(state.client.tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        state.tool_parser = tool_parser(args.tool_call_parser, template)
        state.reasoning_parser = reasoning_parser(args.reasoning_parser, template)
        yield
        await state.client.close()

    app = FastAPI(title="plait", lifespan=lifespan)
    app.state.plait = state
    args = state.args

    app.add_middleware(Guard, api_key=args.api_key, max_body=args.max_request_bytes,
                       allowed_hosts=default_allowed_hosts(args.host) if args.host_list() is None else args.host_list(),
                       allowed_origins=args.origin_list())
    if args.origin_list():  # outermost: answers browsers' preflights for the allowed origins
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=args.origin_list(), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        return error_response(e.status, e.message, e.type)

    @app.exception_handler(BodyError)
    async def _body_error(request: Request, e: BodyError):
        return error_response(e.status, str(e))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError):
        return error_response(400, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, e: StarletteHTTPException):  # 404, 405, ...
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, e: RequestFailed):
        return error_response(e.status, str(e))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        logger.error("unhandled error on %s", request.url.path, exc_info=e)
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, e: QueueFull):
        return error_response(429, str(e))

    @app.exception_handler(RuntimeDead)
    async def _dead(request: Request, e: RuntimeDead):
        return error_response(503, f"the runtime is down: {e}", "server_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return error_response(400, validation_message(e.errors()))

    # ---- SGLang's native API ------------------------------------------------------------
    @app.post("/generate", openapi_extra=_generate_doc())
    async def generate(request: Request):
        body = await read_json(request)
        _check_generate_keys(body)
        inp = GenerateInput(**{k: v for k, v in body.items() if k in _GENERATE_KEYS and v is not None})
        client = state.client
        # errors (400, 429, 503) surface here, before a stream's headers are sent
        msgs = await client.tokenize_async(inp)
        gen = client.results(client.submit(msgs, inp.return_text_in_logprobs), inp.stream, inp.single)
        if inp.stream:
            if constrained(msgs):
                gen = await started(request, client, gen)
            return StreamingResponse(sse(request, gen), media_type="text/event-stream")
        return JSONResponse(await first_or_disconnect(request, client, gen))

    async def get_model_info():
        tok = state.client.tokenizer
        return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path or args.model_path,
                "is_generation": True, "chat_template": getattr(tok, "chat_template", None) if tok else None,
                "served_model_name": state.model_name, "context_length": state.client.limits.context_length}

    app.get("/get_model_info")(get_model_info)
    app.get("/model_info", operation_id="model_info")(get_model_info)  # the name sglang-router asks first

    async def server_info():
        info: dict[str, Any] = {k: getattr(args, k) for k in args.__dataclass_fields__
                                if k not in ("api_key", "api_key_file")}
        info.update({"limits": {"context_length": state.client.limits.context_length,
                                "kv_capacity": state.client.limits.kv_capacity},
                     "version": _version(),
                     "pids": {name: p.pid for name, p in state.runtime.procs.items()} | {"server": os.getpid()}})
        info.update(await state.client.server_info())
        return info

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    async def flush_cache():
        if await state.client.flush_cache():
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are running.\n", status_code=400)

    app.get("/flush_cache", operation_id="flush_cache_get")(flush_cache)
    app.post("/flush_cache", operation_id="flush_cache_post")(flush_cache)

    @app.get("/health")
    async def health():
        if state.client is None or state.client.dead is not None or state.shutting_down:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if state.client.dead is not None:
            return Response(status_code=503)
        ids = [0] if state.client.tokenizer is None else None
        inp = GenerateInput(text=None if ids else "ping", input_ids=ids, sampling_params={"max_new_tokens": 1})
        try:
            result = await asyncio.wait_for(state.client.first(state.client.generate(inp)), timeout=60)
        except (asyncio.TimeoutError, RuntimeDead):
            return Response(status_code=503)
        ok = result["meta_info"]["finish_reason"]["type"] != "abort"
        return Response(status_code=200 if ok else 503)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_json(request)
        refuse_unknown("/abort_request", set(body) - {"rid"})
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise HTTPError(400, "rid must be a string")
        state.client.abort(rid)
        return Response(status_code=200)

    @app.post("/concate_and_append_request")
    async def concate_and_append_request():
        # the sglang frontend sends this on join with ids the server never saw; it resends the full
        # text with its next call. plait's own frontend uses /join_kv instead.
        return Response(status_code=200)

    @app.post("/join_kv", openapi_extra=_join_kv_doc())
    async def join_kv(request: Request):
        """concate_and_append: {"fork_text", "branch_texts": [...], "kv_joins": [...]} -> {"join_id",
        "input_ids", "reused"} (or {"join_id": null, "reason"}); later /generate calls that list
        join_id in kv_joins reuse the joined KV."""
        body = await read_json(request)
        refuse_unknown("/join_kv", set(body) - {"fork_text", "branch_texts", "kv_joins"})
        return await state.client.join_kv(body.get("fork_text"), body.get("branch_texts"), body.get("kv_joins"))

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            raise HTTPError(404, "metrics are off: start the server with --enable-metrics")
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    from plait.runtime.entrypoints.openai_api import add_openai_routes
    from plait.runtime.entrypoints.responses_api import add_responses_routes

    add_openai_routes(app, state)
    add_responses_routes(app, state)

    def openapi() -> dict:  # the OpenAI routes read their bodies themselves: add the models they document
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            from plait.runtime.entrypoints.openai_api import openapi_components

            schema = get_openapi(title=app.title, version=_version(), routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def _generate_doc() -> dict:
    """/generate's body for /openapi.json (the route reads and checks the body itself)."""
    import msgspec

    from plait.runtime.sampling import SamplingParams

    sp = msgspec.json.schema(SamplingParams)["$defs"]["SamplingParams"]
    one_or_many = lambda item: {"anyOf": [item, {"type": "array", "items": item}]}  # noqa: E731
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    schema = {"type": "object", "additionalProperties": False, "properties": {
        "text": one_or_many({"type": "string"}), "input_ids": one_or_many(ids),
        "sampling_params": one_or_many(sp), "return_logprob": one_or_many({"type": "boolean"}),
        "logprob_start_len": one_or_many({"type": "integer", "minimum": -1}),
        "top_logprobs_num": one_or_many({"type": "integer", "minimum": 0}),
        "return_text_in_logprobs": {"type": "boolean"}, "stream": {"type": "boolean"},
        "rid": one_or_many({"type": "string"}), "kv_joins": _kv_joins_schema()}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _kv_joins_schema() -> dict:
    return {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_JOIN_ID_CHARS},
            "maxItems": MAX_KV_JOINS}


def _join_kv_doc() -> dict:
    schema = {"type": "object", "additionalProperties": False, "required": ["fork_text", "branch_texts"],
              "properties": {"fork_text": {"type": "string", "minLength": 1},
                             "branch_texts": {"type": "array", "items": {"type": "string"}, "minItems": 2,
                                              "maxItems": 64},
                             "kv_joins": _kv_joins_schema()}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# ---- helpers shared with the OpenAI routes ------------------------------------------------
async def read_json(request: Request) -> dict:
    """The body as a checked JSON object (http_guard.parse_json_body). Its size is bounded by the
    Guard middleware, chunked bodies included."""
    raw = b"".join([chunk async for chunk in request.stream()])
    if len(raw) > _THREAD_PARSE_BYTES:  # a big body is parsed off the event loop
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plait")
    except PackageNotFoundError:
        return "0"


# ---- launch ------------------------------------------------------------------------------
def launch_server(args: ServerArgs) -> int:
    """Start the runtime and serve until SIGINT/SIGTERM (exit 0) or a runtime process dies (exit 1)."""
    import uvicorn

    from plait.runtime.launch.launcher import launch_node, launch_runtime
    from plait.runtime.client.metrics import Metrics

    args = args.resolved()
    logging.basicConfig(level=args.log_level.upper(), format="[plait %(asctime)s] %(message)s")
    if args.node_rank > 0:  # another machine's ranks of a model node 0 serves
        return launch_node(args)
    start = time.perf_counter()
    runtime = launch_runtime(args)
    state = ServerState(args, runtime, Metrics(served_model_name(args)) if args.enable_metrics else None)
    app = create_app(state)
    # uvicorn's own cut-off comes after plait's drain has ended what was left with an error
    limits = ConnectionLimits(args.header_timeout, args.body_timeout, args.keep_alive_timeout, args.max_connections)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=guarded_protocol(limits), timeout_keep_alive=args.keep_alive_timeout,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, access_log=args.log_level == "debug")
    server = _server_class()(config)
    exit_code = 0

    def on_death(why: str) -> None:
        nonlocal exit_code
        exit_code = 1
        # /health answers 503 a moment (the in-flight requests get their 503s), then the server exits
        asyncio.get_running_loop().call_later(_DEATH_GRACE, lambda: setattr(server, "should_exit", True))

    state.on_death = on_death

    def on_signal() -> None:
        """Graceful stop: refuse new requests, let in-flight ones finish for --shutdown-timeout, then
        end the rest with an error (streams get an error event and [DONE]), then exit 0."""
        if state.shutting_down:
            server.force_exit = True  # a second signal: stop now
            return
        state.shutting_down = True
        if state.client is not None:
            state.client.draining = True
        server.should_exit = True
        asyncio.get_running_loop().call_later(args.shutdown_timeout, _end_in_flight)

    def _end_in_flight() -> None:
        if state.client is not None and state.client.states:
            logger.warning("shutdown: ending %d requests still in flight after %g s", len(state.client.states),
                           args.shutdown_timeout)
            state.client.end_all("the server is shutting down")

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        announce = asyncio.ensure_future(_announce(server, args, start))
        try:
            await server.serve()
        finally:
            announce.cancel()

    try:
        asyncio.run(serve())
    finally:
        runtime.shutdown()
    if not server.started and exit_code == 0:
        exit_code = 1  # e.g. the port was taken
    return exit_code


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        # uvicorn re-raises a caught SIGTERM after shutting down (exit by signal); plait handles the
        # signals itself so a graceful stop exits 0
        def capture_signals(self):
            return contextlib.nullcontext()

    return Server


async def _announce(server, args: ServerArgs, start: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info("plait server ready at http://%s:%d (model %s, %.1f s to start)", args.host, args.port,
                args.model_path, time.perf_counter() - start)
