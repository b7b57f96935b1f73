"""Embeddings: OpenAI's /v1/embeddings and SGLang's native /encode, on the runtime client's `embed` (the
scheduler pools the final hidden states: pooling.py). Ollama's /api/embed is in ollama_api.py.

A request naming no model is embedded by the --embedding-model where there is one, else by the main model;
naming the main model, by the main model (a decoder pools its own states)."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request

from plait.runtime.client import EmbedInput, RuntimeClient
from plait.runtime.client.embeddings import base64_floats, native_result
from plait.runtime.entrypoints.common import (ServerState, embedding_model, first_or_disconnect, read_json,
                                              refuse_unknown, server_state)
from plait.runtime.entrypoints.openai_api import body_doc, parse_body
from plait.runtime.entrypoints.openai_protocol import EmbeddingRequest

router = APIRouter()


async def embedded(request: Request, client: RuntimeClient, inp: EmbedInput) -> tuple[list[list[float]], list[int]]:
    """client.embed, its requests aborted if the HTTP client hangs up."""
    async def once() -> AsyncIterator:
        yield await client.embed(inp)

    return await first_or_disconnect(request, client, once())


@router.post("/v1/embeddings", openapi_extra=body_doc(EmbeddingRequest))
async def embeddings(request: Request, state: ServerState = Depends(server_state)):
    req = await parse_body(request, EmbeddingRequest, state, check_model=False)
    encoder = embedding_model(state, req.model)
    inp = state.client.embed_input(req.input, encoder=encoder, dimensions=req.dimensions)
    vectors, tokens = await embedded(request, state.client, inp)
    encode = base64_floats if req.encoding_format == "base64" else (lambda v: v)
    return {"object": "list", "model": state.encoder_name if encoder else state.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}}


_ENCODE_FIELDS = {"text", "input_ids", "dimensions", "rid", "model", "pooling"}


@router.post("/encode")
async def encode(request: Request, state: ServerState = Depends(server_state)):
    """SGLang's native embedding route: `text` (a string or a list) or `input_ids`, and plait's `pooling`;
    {"embedding", "meta_info"} for one input, a list of them for a batch."""
    body = await read_json(request)
    refuse_unknown("/encode", set(body) - _ENCODE_FIELDS)
    if ("text" in body) == ("input_ids" in body):
        raise ValueError("give exactly one of text or input_ids")
    field = "text" if "text" in body else "input_ids"
    model = body.get("model")
    encoder = embedding_model(state, model if isinstance(model, str) or model is None else str(model))
    inp = state.client.embed_input(body[field], field, encoder, dimensions=body.get("dimensions"),
                                   pooling=body.get("pooling"))
    return native_result(body[field], *await embedded(request, state.client, inp))
