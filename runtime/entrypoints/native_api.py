"""SGLang's native API: /generate, /get_model_info, /server_info, /flush_cache, /health, /health_generate,
/abort_request, /join_kv, /metrics."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from plait.runtime.client import GenerateInput, RuntimeDead
from plait.runtime.entrypoints.common import (HTTPError, ServerState, constrained, first_or_disconnect, read_json,
                                              refuse_unknown, server_state, sse, started, version)
from plait.runtime.ipc.limits import MAX_JOIN_ID_CHARS, MAX_KV_JOINS

_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                  "return_text_in_logprobs", "stream", "rid", "kv_joins", "lora_path"}
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
        "rid": one_or_many({"type": "string"}), "kv_joins": _kv_joins_schema(),
        "lora_path": one_or_many({"type": ["string", "null"]})}}
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


router = APIRouter()


@router.post("/generate", openapi_extra=_generate_doc())
async def generate(request: Request, state: ServerState = Depends(server_state)):
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

async def get_model_info(state: ServerState = Depends(server_state)):
    args = state.args
    tok = state.client.tokenizer
    return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path or args.model_path,
            "is_generation": True, "chat_template": getattr(tok, "chat_template", None) if tok else None,
            "served_model_name": state.model_name, "context_length": state.client.limits.context_length}

router.get("/get_model_info")(get_model_info)
router.get("/model_info", operation_id="model_info")(get_model_info)  # the name sglang-router asks first

async def server_info(state: ServerState = Depends(server_state)):
    args = state.args
    info: dict[str, Any] = {k: getattr(args, k) for k in args.__dataclass_fields__
                            if k not in ("api_key", "api_key_file")}
    info.update({"limits": {"context_length": state.client.limits.context_length,
                            "kv_capacity": state.client.limits.kv_capacity},
                 "version": version(),
                 "pids": {name: p.pid for name, p in state.runtime.procs.items()} | {"server": os.getpid()}})
    info.update(await state.client.server_info())
    return info

router.get("/server_info")(server_info)
router.get("/get_server_info")(server_info)

async def flush_cache(state: ServerState = Depends(server_state)):
    if await state.client.flush_cache():
        return Response("Cache flushed.\n", status_code=200)
    return Response("Cache not flushed: requests are running.\n", status_code=400)

router.get("/flush_cache", operation_id="flush_cache_get")(flush_cache)
router.post("/flush_cache", operation_id="flush_cache_post")(flush_cache)

@router.get("/health")
async def health(state: ServerState = Depends(server_state)):
    if state.client is None or state.client.dead is not None or state.shutting_down:
        return Response(status_code=503)
    return Response(status_code=200)

@router.get("/health_generate")
async def health_generate(state: ServerState = Depends(server_state)):
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

@router.post("/abort_request")
async def abort_request(request: Request, state: ServerState = Depends(server_state)):
    body = await read_json(request)
    refuse_unknown("/abort_request", set(body) - {"rid"})
    rid = body.get("rid")
    if not isinstance(rid, str):
        raise HTTPError(400, "rid must be a string")
    state.client.abort(rid)
    return Response(status_code=200)

@router.post("/concate_and_append_request")
async def concate_and_append_request():
    # the sglang frontend sends this on join with ids the server never saw; it resends the full
    # text with its next call. plait's own frontend uses /join_kv instead.
    return Response(status_code=200)

@router.post("/join_kv", openapi_extra=_join_kv_doc())
async def join_kv(request: Request, state: ServerState = Depends(server_state)):
    """concate_and_append: {"fork_text", "branch_texts": [...], "kv_joins": [...]} -> {"join_id",
    "input_ids", "reused"} (or {"join_id": null, "reason"}); later /generate calls that list
    join_id in kv_joins reuse the joined KV."""
    body = await read_json(request)
    refuse_unknown("/join_kv", set(body) - {"fork_text", "branch_texts", "kv_joins"})
    return await state.client.join_kv(body.get("fork_text"), body.get("branch_texts"), body.get("kv_joins"))

@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)):
    if state.metrics is None:
        raise HTTPError(404, "metrics are off: start the server with --enable-metrics")
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, state: ServerState = Depends(server_state)):
    """SGLang's route: {"lora_name", "lora_path"}; answers {"success", "error_message", "loaded_adapters"}."""
    body = await read_json(request)
    refuse_unknown("/load_lora_adapter", set(body) - {"lora_name", "lora_path", "pinned"})
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str):
        raise HTTPError(400, "lora_name and lora_path must be strings")
    return await _lora_answer(state.client.load_lora(name, path))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, state: ServerState = Depends(server_state)):
    """SGLang's route: {"lora_name"}; the requests running with the adapter finish with it."""
    body = await read_json(request)
    refuse_unknown("/unload_lora_adapter", set(body) - {"lora_name"})
    if not isinstance(body.get("lora_name"), str):
        raise HTTPError(400, "lora_name must be a string")
    return await _lora_answer(state.client.unload_lora(body["lora_name"]))


async def _lora_answer(call) -> JSONResponse:
    adapters, error = await call
    if error:
        return JSONResponse({"success": False, "error_message": error, "loaded_adapters": adapters}, status_code=400)
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": adapters})
