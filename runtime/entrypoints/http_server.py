"""The HTTP server: FastAPI on uvicorn, one client of the runtime processes.

The app is SGLang's native API (native_api.py), the OpenAI API (openai_api.py, responses_api.py), embeddings
(embeddings_api.py), Ollama's
(ollama_api.py) and the Guard middleware (http_guard.py), with errors as 4xx/5xx and an OpenAI-style body
`{"error": {"message", "type", "code"}}` (Ollama's `{"error": "..."}` on its routes); the server keeps serving. `launch_server` starts the runtime and
serves until a signal (which drains) or a runtime process's death (which fails loudly).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from plait.runtime.client import QueueFull, RequestFailed, RuntimeClient, RuntimeDead
from plait.runtime.entrypoints.common import (HTTPError, ServerState, error_response, ollama_error, served_model_name,
                                              validation_message, version)
from plait.runtime.entrypoints.connections import ConnectionLimits, guarded_protocol
from plait.runtime.entrypoints.http_guard import BodyError, Guard, default_allowed_hosts
from plait.runtime.entrypoints.chat_page import router as chat_page_router
from plait.runtime.entrypoints.embeddings_api import router as embeddings_router
from plait.runtime.entrypoints.native_api import router as native_router
from plait.runtime.entrypoints.ollama_api import router as ollama_router
from plait.runtime.entrypoints.openai_api import router as openai_router
from plait.runtime.entrypoints.responses_api import router as responses_router
from plait.runtime.parsers import reasoning_parser, tool_parser
from plait.runtime.server_args import ServerArgs

if TYPE_CHECKING:
    from plait.runtime.launch.launcher import StartingRuntime

logger = logging.getLogger(__name__)

# a runtime that died keeps answering 503 (on /health too) this long before the server exits
_DEATH_GRACE = 2.0


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

    def _error(request: Request, status: int, message: str, type_: str | None = None):
        """OpenAI's error body, or Ollama's (`{"error": "..."}`) on its routes."""
        if request.url.path.startswith("/api/"):
            return ollama_error(status, message)
        return error_response(status, message, type_)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        return _error(request, e.status, e.message, e.type)

    @app.exception_handler(BodyError)
    async def _body_error(request: Request, e: BodyError):
        return _error(request, e.status, str(e))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError):
        return _error(request, 400, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, e: StarletteHTTPException):  # 404, 405, ...
        return _error(request, e.status_code, str(e.detail))

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, e: RequestFailed):
        return _error(request, e.status, str(e))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        logger.error("unhandled error on %s", request.url.path, exc_info=e)
        return _error(request, 500, f"internal error: {type(e).__name__}: {e}")

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, e: QueueFull):
        return _error(request, 429, str(e))

    @app.exception_handler(RuntimeDead)
    async def _dead(request: Request, e: RuntimeDead):
        return _error(request, 503, f"the runtime is down: {e}", "server_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return _error(request, 400, validation_message(e.errors()))

    app.include_router(native_router)
    app.include_router(embeddings_router)
    app.include_router(openai_router)
    app.include_router(responses_router)
    app.include_router(ollama_router)
    app.include_router(chat_page_router)

    def openapi() -> dict:  # the OpenAI routes read their bodies themselves: add the models they document
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            from plait.runtime.entrypoints.openai_api import openapi_components

            schema = get_openapi(title=app.title, version=version(), routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


# ---- launch ------------------------------------------------------------------------------
def launch_server(args: ServerArgs, starting: StartingRuntime | None = None) -> int:
    """Start the runtime (or take `starting`, its processes started with `args` resolved) and serve until
    SIGINT/SIGTERM (exit 0) or a runtime process dies (exit 1)."""
    import uvicorn

    from plait.runtime.launch.launcher import launch_node, start_runtime
    from plait.runtime.client.metrics import Metrics

    args = args.resolved()
    logging.basicConfig(level=args.log_level.upper(), format="[plait %(asctime)s] %(message)s")
    if args.node_rank > 0:  # another machine's ranks of a model node 0 serves
        return launch_node(args)
    starting = starting or start_runtime(args)
    start = starting.started
    runtime = starting.wait()
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
