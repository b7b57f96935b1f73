"""Ollama's API on the same port, for the apps that speak it (editors, note apps, chat front-ends).

An adapter, not a second server: `/api/chat` becomes an OpenAI chat request (the chat template, tools through the
tool-call layer, `format` through the grammars, `options` as sampling) and its reply is read back into Ollama's
shape; `/api/generate` is a completion of the templated prompt (or the raw one); `/api/embed` (and the older
`/api/embeddings`) the inputs' embeddings (embeddings_api.py). Replies stream as NDJSON unless
`stream` is false; errors are `{"error": "..."}` as Ollama's are. One model is served: `/api/tags`, `/api/ps` and
`/api/show` describe it under a name Ollama's apps can send back (`<name>:latest`; the OpenAI names work too)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import re
import time
from datetime import datetime, timezone
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from plait.runtime.client import QueueFull, RequestFailed, RuntimeDead
from plait.runtime.client.request import ReqState
from plait.runtime.entrypoints.common import (HTTPError, ServerState, constrained, first_or_disconnect, server_state,
                                              started, validated_body, validation_message)
from plait.runtime.entrypoints.http_guard import shown
from plait.runtime.entrypoints.embeddings_api import embedded
from plait.runtime.entrypoints.ollama_protocol import (ChatRequest, EmbedRequest, GenerateRequest,
                                                       LegacyEmbeddingsRequest, ShowRequest)
from plait.runtime.entrypoints.openai_api import chat_prompt, chat_requests, max_new_tokens, tokenized_request
from plait.runtime.entrypoints.openai_protocol import ChatCompletionRequest
from plait.runtime.entrypoints.openai_render import ChatView

# the Ollama release whose API this follows (apps check it before using newer fields)
OLLAMA_VERSION = "0.12.0"
_STARTED = datetime.now(timezone.utc)
_DONE = {"stop": "stop", "tool_calls": "stop", "length": "length", "abort": "stop"}

router = APIRouter()


def ollama_name(state: ServerState) -> str:
    name = os.path.splitext(state.model_name)[0] if state.model_name.endswith(".gguf") else state.model_name
    return name if ":" in name else f"{name}:latest"


def _check_model(state: ServerState, name: str) -> None:
    if name == ollama_name(state) or name in state.model_aliases or name.removesuffix(":latest") in state.model_aliases:
        return
    raise HTTPError(404, f"model '{shown(name)}' not found (this server serves '{ollama_name(state)}')")


def _embedder(state: ServerState, name: str) -> bool:
    """Whether /api/embed's `model` is the --embedding-model (else the main model)."""
    if name.removesuffix(":latest") in state.encoder_aliases:
        return True
    _check_model(state, name)
    return False


async def _body(request: Request, model: type[BaseModel], state: ServerState, check_model: bool = True):
    req = await validated_body(request, model)
    if check_model:
        _check_model(state, req.model_name() if isinstance(req, ShowRequest) else req.model)
    return req


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@functools.lru_cache(maxsize=4)
def _details(path: str) -> dict[str, Any]:
    """What Ollama says of a model, read from its GGUF header or config.json."""
    family, size, quant, fmt = "", "", "", "gguf" if path.endswith(".gguf") else "safetensors"
    try:
        if fmt == "gguf":
            from plait.runtime.model_loader.gguf_file import GGUFFile

            meta = GGUFFile(path).metadata
            family, size = str(meta.get("general.architecture", "")), str(meta.get("general.size_label", ""))
        else:
            with open(os.path.join(path, "config.json")) as f:
                family = str(json.load(f).get("model_type", ""))
    except (OSError, ValueError):
        pass
    found = re.search(r"(?i)\b(Q\d_[A-Z0-9_]+|Q\d_\d|F16|F32|BF16)\b", os.path.basename(path).replace(".", " "))
    quant = found.group(1).upper() if found else quant
    return {"parent_model": "", "format": fmt, "family": family, "families": [family] if family else [],
            "parameter_size": size, "quantization_level": quant}


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def _entry(state: ServerState) -> dict[str, Any]:
    return _model_entry(state.args.model_path, ollama_name(state))


def _model_entry(path: str, name: str) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": _STARTED.isoformat(), "size": _size(path),
            "digest": hashlib.sha256(os.path.abspath(path).encode()).hexdigest(), "details": _details(path)}


def _entries(state: ServerState) -> list[dict[str, Any]]:
    """The main model, and the --embedding-model where there is one."""
    out = [_entry(state)]
    if state.encoder_name is not None:
        out.append(_model_entry(state.args.embedding_model_path, f"{state.encoder_name}:latest"))
    return out


# ---- the model ---------------------------------------------------------------------------------------------
@router.get("/api/version")
async def ollama_version():
    return {"version": OLLAMA_VERSION}


@router.get("/api/tags")
async def tags(state: ServerState = Depends(server_state)):
    return {"models": await asyncio.to_thread(_entries, state)}


@router.get("/api/ps")
async def ps(state: ServerState = Depends(server_state)):
    entry = await asyncio.to_thread(_entry, state)
    return {"models": [{**{k: entry[k] for k in ("name", "model", "size", "digest", "details")},
                        "expires_at": "2318-01-01T00:00:00Z",  # loaded for as long as the server runs
                        "size_vram": 0, "context_length": state.client.limits.context_length}]}


@router.post("/api/show")
async def show(request: Request, state: ServerState = Depends(server_state)):
    req = await _body(request, ShowRequest, state, check_model=False)
    encoder = _embedder(state, req.model_name())
    if encoder:
        entry = await asyncio.to_thread(_model_entry, state.args.embedding_model_path, f"{state.encoder_name}:latest")
    else:
        entry = await asyncio.to_thread(_entry, state)
    tok = state.client.encoder_tokenizer if encoder else state.client.tokenizer
    limits = state.client.embedding_limits(encoder)
    template = getattr(tok, "chat_template", None)
    details = entry["details"]
    # every model takes tools through plait's tool-call layer; an encoder only embeds
    capabilities = ["completion", "tools"] if limits.generates else ["embedding"]
    return {"license": "", "modelfile": f"FROM {state.args.model_path}\n", "parameters": "",
            "template": template if isinstance(template, str) else "", "details": details,
            "model_info": {"general.architecture": details["family"], "general.parameter_count": None,
                           f"{details['family'] or 'model'}.context_length": limits.context_length},
            "capabilities": capabilities, "modified_at": entry["modified_at"]}


# ---- chat and generate -------------------------------------------------------------------------------------
def _stats(st: ReqState) -> dict[str, Any]:
    """Ollama's counts and durations (nanoseconds)."""
    end = time.perf_counter()
    first = st.first_token_at or end
    last = st.last_token_at or end
    return {"total_duration": int((end - st.created) * 1e9), "load_duration": 0,
            "prompt_eval_count": st.counts["prompt_tokens"], "prompt_eval_duration": int((first - st.created) * 1e9),
            "eval_count": st.counts["completion_tokens"], "eval_duration": int(max(last - first, 0) * 1e9)}


def _loaded(model: str, unload: bool, chat: bool) -> dict[str, Any]:
    """The answer to a request with nothing to generate: Ollama's way to load (or unload) a model."""
    out: dict[str, Any] = {"model": model, "created_at": _now(), "done": True,
                           "done_reason": "unload" if unload else "load"}
    return {**out, "message": {"role": "assistant", "content": ""}} if chat else {**out, "response": ""}


def _max_new(num_predict: int | None) -> int | None:
    return num_predict if num_predict is not None and num_predict > 0 else None


@router.post("/api/chat")
async def chat(request: Request, state: ServerState = Depends(server_state)):
    req = await _body(request, ChatRequest, state)
    if not req.messages or req.num_predict() == 0:
        return _answer(req.stream, _loaded(req.model, req.keep_alive in (0, "0"), chat=True))
    try:
        body = {"model": None, "messages": req.openai_messages(), "stream": req.stream, **req.openai_fields()}
        if req.tools:
            body["tools"] = req.tools
        creq = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise HTTPError(400, validation_message(e.errors(include_url=False))) from None
    client = state.client
    msgs, inside = await asyncio.to_thread(chat_requests, state, creq)
    states = client.submit(msgs)
    view = ChatView(state, creq, states, inside)
    gen = client.results(states, req.stream, single=False)
    if not req.stream:
        await first_or_disconnect(request, client, gen)
        message, finish = view.message(states[0])
        return JSONResponse({"model": req.model, "created_at": _now(), "message": _message(message, req.think),
                             "done": True, "done_reason": _DONE[finish or "stop"], **_stats(states[0])})
    if constrained(msgs):
        gen = await started(request, client, gen)
    return StreamingResponse(_ndjson(_chat_lines(req, view, states[0], gen)), media_type="application/x-ndjson")


def _message(m: dict, think) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": m.get("content") or ""}
    if think and m.get("reasoning_content"):
        out["thinking"] = m["reasoning_content"]
    if m.get("tool_calls"):
        out["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                           "arguments": json.loads(c["function"]["arguments"] or "{}")}}
                             for c in m["tool_calls"]]
    return out


async def _chat_lines(req: ChatRequest, view: ChatView, st: ReqState, gen: AsyncIterator) -> AsyncIterator[dict]:
    """A line per reply delta (content, thinking, each tool call once whole), then the closing line."""
    calls: dict[int, dict] = {}
    finish = None
    async for snap in gen:
        for chunk in view.chunk(snap):
            choice = chunk["choices"][0]
            d = choice["delta"]
            finish = choice["finish_reason"] or finish
            message: dict[str, Any] = {"role": "assistant", "content": d.get("content") or ""}
            if req.think and d.get("reasoning_content"):
                message["thinking"] = d["reasoning_content"]
            for call in d.get("tool_calls") or []:  # a call's name comes first, its arguments whole after
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] = call["function"].get("name") or entry["name"]
                entry["arguments"] += call["function"].get("arguments") or ""
                if call["function"].get("arguments"):
                    message["tool_calls"] = [{"function": {"name": entry["name"],
                                                           "arguments": json.loads(entry["arguments"])}}]
            if message["content"] or len(message) > 2:
                yield {"model": req.model, "created_at": _now(), "message": message, "done": False}
    yield {"model": req.model, "created_at": _now(), "message": {"role": "assistant", "content": ""}, "done": True,
           "done_reason": _DONE[finish or "stop"], **_stats(st)}


@router.post("/api/generate")
async def generate(request: Request, state: ServerState = Depends(server_state)):
    req = await _body(request, GenerateRequest, state)
    if (not req.prompt and not req.context) or req.num_predict() == 0:
        return _answer(req.stream, _loaded(req.model, req.keep_alive in (0, "0"), chat=False))
    client = state.client
    msg = await asyncio.to_thread(_generate_request, state, req)
    states = client.submit([msg])
    gen = client.results(states, req.stream, single=False)
    st = states[0]
    if not req.stream:
        await first_or_disconnect(request, client, gen)
        return JSONResponse({"model": req.model, "created_at": _now(), "response": st.text, "done": True,
                             "done_reason": _DONE[st.finish.type], "context": st.msg.input_ids + st.output_ids,
                             **_stats(st)})
    if constrained([msg]):
        gen = await started(request, client, gen)
    return StreamingResponse(_ndjson(_generate_lines(req, st, gen)), media_type="application/x-ndjson")


def _generate_request(state: ServerState, req: GenerateRequest):
    """The prompt (templated as one user turn, after `system`, unless raw) after any earlier context's ids."""
    client = state.client
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
               [{"role": "user", "content": req.prompt or " " if req.raw else req.prompt}]
    # the turn as a chat request: its sampling parameters, and unless raw its template
    creq = ChatCompletionRequest.model_validate({"messages": messages, **req.openai_fields()})
    text = req.prompt if req.raw else chat_prompt(client, creq, state.tool_parser)
    ids = list(req.context or []) + (client.encode(text, "prompt", add_special_tokens=False) if text else [])
    params = creq.sampling_params(max_new_tokens(client, len(ids), creq.max_tokens), 0)
    return tokenized_request(client, ids, params, None, req.stream)


async def _generate_lines(req: GenerateRequest, st: ReqState, gen: AsyncIterator) -> AsyncIterator[dict]:
    sent = 0
    async for _ in gen:
        if len(st.text) > sent:
            yield {"model": req.model, "created_at": _now(), "response": st.text[sent:], "done": False}
            sent = len(st.text)
    yield {"model": req.model, "created_at": _now(), "response": "", "done": True,
           "done_reason": _DONE[st.finish.type if st.finish else "stop"],
           "context": st.msg.input_ids + st.output_ids, **_stats(st)}


def _answer(stream: bool, body: dict):
    if not stream:
        return JSONResponse(body)
    return StreamingResponse(_ndjson(_one(body)), media_type="application/x-ndjson")


async def _one(body: dict) -> AsyncIterator[dict]:
    yield body


async def _ndjson(lines: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """A JSON object per line; an error after the stream started ends it with an `{"error": ...}` line."""
    try:
        async for line in lines:
            yield json.dumps(line, ensure_ascii=False).encode() + b"\n"
    except (ValueError, QueueFull, RuntimeDead, RequestFailed) as e:
        yield json.dumps({"error": str(e)}).encode() + b"\n"
    except Exception as e:  # noqa: BLE001 - a bug rendering this stream ends it with an error line
        yield json.dumps({"error": f"internal error: {type(e).__name__}: {e}"}).encode() + b"\n"
    finally:
        await lines.aclose()


# ---- embeddings --------------------------------------------------------------------------------------------
@router.post("/api/embed")
async def embed(request: Request, state: ServerState = Depends(server_state)):
    req = await _body(request, EmbedRequest, state, check_model=False)
    encoder = _embedder(state, req.model)
    start = time.perf_counter()
    out: dict[str, Any] = {"model": req.model, "embeddings": []}
    if req.input in (None, "", []):  # nothing to embed: Ollama's way to load the model
        return out
    inp = state.client.embed_input(req.input, encoder=encoder, dimensions=req.dimensions, truncate=req.truncate)
    vectors, tokens = await embedded(request, state.client, inp)
    return {**out, "embeddings": vectors, "total_duration": int((time.perf_counter() - start) * 1e9),
            "load_duration": 0, "prompt_eval_count": sum(tokens)}


@router.post("/api/embeddings")
async def embeddings_legacy(request: Request, state: ServerState = Depends(server_state)):
    req = await _body(request, LegacyEmbeddingsRequest, state, check_model=False)
    encoder = _embedder(state, req.model)
    if not req.prompt:
        return {"embedding": []}
    inp = state.client.embed_input(req.prompt, "prompt", encoder, truncate=True)
    vectors, _ = await embedded(request, state.client, inp)
    return {"embedding": vectors[0]}
