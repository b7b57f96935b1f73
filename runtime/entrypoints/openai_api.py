"""The OpenAI API on top of the runtime client: /v1/models, /v1/completions, /v1/chat/completions (the Responses
API, responses_api.py, runs through the chat path here).

Shapes follow what the official `openai` Python client parses. `n` choices run as n requests of
the same prompt (the radix cache computes the prompt once); usage reports cached prompt tokens.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from plait.runtime.entrypoints.http_guard import shown
from plait.runtime.entrypoints.common import (HTTPError, ServerState, constrained, first_or_disconnect, server_state,
                                              sse, started, validated_body)
from plait.runtime.ipc.messages import TokenizedGenerateReq
from plait.runtime.ipc.limits import validate_request
from plait.runtime.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from plait.runtime.sampling import SamplingParams
from plait.runtime.client import ReqState, RuntimeClient
from plait.runtime.entrypoints.lark import after_reasoning, json_body
from plait.runtime.entrypoints.tool_calls import either_grammar, either_schema, tool_call_schema, tool_mode
from plait.runtime.entrypoints.openai_render import ChatView, CompletionView, View
from plait.runtime.parsers import ToolCallParser


async def parse_body(request: Request, model: type[BaseModel], state: ServerState, check_model: bool = True):
    """The body as `model` (common.validated_body); a 404 for a model that is not served (unless the caller
    checks it)."""
    req = await validated_body(request, model)
    if check_model:
        adapter_of(state, req.model)
    return req


def adapter_of(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names: `base:adapter` or the adapter's own name (None: the base
    model); a 404 for a name the server does not serve."""
    if model is None or model in state.model_aliases:
        return None
    adapters = state.client.lora_adapters
    base, _, name = model.rpartition(":")
    if model in adapters:
        return model
    if base in state.model_aliases and name in adapters:
        return name
    served = ", ".join(f"`{n}`" for n in [state.model_name, *sorted(adapters)])
    raise HTTPError(404, f"The model `{shown(model)}` does not exist (this server serves {served}).")


def body_doc(model: type[BaseModel]) -> dict:
    """The request body's schema for /openapi.json (the route reads the body itself, strictly)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


def openapi_components() -> dict:
    """The models referenced by the request bodies' schemas, for /openapi.json's components."""
    defs = {}
    for model in (CompletionRequest, ChatCompletionRequest, ResponsesRequest):
        defs.update(model.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {}))
    return defs


router = APIRouter()


@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)):
    data = [{"id": state.model_name, "object": "model", "created": _START, "owned_by": "plait",
             "root": state.args.model_path, "max_model_len": state.client.limits.context_length}]
    for name in sorted(state.client.lora_adapters):  # LoRA adapters over the model: `model: NAME` picks one
        data.append({"id": name, "object": "model", "created": _START, "owned_by": "plait", "root": name,
                     "parent": state.model_name, "max_model_len": state.client.limits.context_length})
    if state.encoder_name is not None:  # the --embedding-model
        data.append({"id": state.encoder_name, "object": "model", "created": _START, "owned_by": "plait",
                     "root": state.args.embedding_model_path,
                     "max_model_len": state.client.encoder_limits.context_length})
    return {"object": "list", "data": data}


@router.post("/v1/completions", openapi_extra=body_doc(CompletionRequest))
async def completions(request: Request, state: ServerState = Depends(server_state)):
    req = await parse_body(request, CompletionRequest, state)
    client = state.client
    if req.echo and req.logprobs is not None:
        raise HTTPError(400, "echo with logprobs is not supported")
    lora = adapter_of(state, req.model)
    msgs, prompts = await asyncio.to_thread(_completion_requests, client, req, lora)  # tokenizing off the loop
    states = client.submit(msgs)
    echo = [client.tokenizer.decode(ids) if req.echo and client.tokenizer else "" for ids in prompts]
    view = CompletionView(state, req, states, echo)
    return await _respond(request, client, states, view)


@router.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest))
async def chat_completions(request: Request, state: ServerState = Depends(server_state)):
    req = await parse_body(request, ChatCompletionRequest, state)
    client = state.client
    msgs, inside = await asyncio.to_thread(chat_requests, state, req)  # templates and tokenizing off the loop
    states = client.submit(msgs)
    view = ChatView(state, req, states, inside)
    return await _respond(request, client, states, view)


def _completion_requests(client: RuntimeClient, req: CompletionRequest, lora: str | None
                         ) -> tuple[list[TokenizedGenerateReq], list]:
    prompts = _completion_prompts(client, req.prompt)
    msgs = []
    for ids in prompts:
        max_new = max_new_tokens(client, len(ids), req.max_tokens)
        for i in range(req.n):
            msgs.append(tokenized_request(client, ids, req.sampling_params(max_new, i), req.logprobs, req.stream,
                                          lora))
    return msgs, prompts


def chat_requests(state: ServerState, req: ChatCompletionRequest) -> tuple[list[TokenizedGenerateReq], bool]:
    """The requests of a chat body, and whether the prompt opened a reasoning block (the reply starts in it)."""
    client = state.client
    text = chat_prompt(client, req, state.tool_parser)
    ids = client.encode(text, "messages", add_special_tokens=False)
    max_new = max_new_tokens(client, len(ids), req.max_completion_tokens or req.max_tokens)
    top = (req.top_logprobs or 0) if req.logprobs else None
    reasoning = state.reasoning_parser
    inside = reasoning is not None and text.rstrip().endswith(reasoning.open)
    try:
        forced = _constraint(req, state, inside)
    except ValueError as e:  # the schema policy's refusal of an embedded schema
        raise HTTPError(400, str(e)) from None
    params = [{**req.sampling_params(max_new, i), **forced} for i in range(req.n)]
    lora = adapter_of(state, req.model)
    return [tokenized_request(client, ids, params[i], top, req.stream, lora) for i in range(req.n)], inside


_START = int(time.time())


async def _respond(request: Request, client: RuntimeClient, states: list[ReqState], view: "View"):
    """SSE chunks as the requests progress, or one response when they are all done."""
    gen = client.results(states, view.req.stream, single=False)
    if view.req.stream:
        if constrained([st.msg for st in states]):
            gen = await started(request, client, gen)
        return StreamingResponse(sse(request, gen, view.chunk), media_type="text/event-stream")
    await first_or_disconnect(request, client, gen)
    return JSONResponse(view.final())


# ---- request building -----------------------------------------------------------------------
def _completion_prompts(client: RuntimeClient, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if client.tokenizer is None:
                raise HTTPError(400, "text prompts need a tokenizer: send token ids")
            out.append(client.encode(p, f"prompt[{i}]"))
        else:
            out.append(list(p))
    return out


def chat_prompt(client: RuntimeClient, req: ChatCompletionRequest, parser: ToolCallParser) -> str:
    tok = client.tokenizer
    if not client.limits.generates:
        raise HTTPError(400, "this model computes embeddings only (/v1/embeddings, /encode, /api/embed)")
    if tok is None or not getattr(tok, "chat_template", None):
        raise HTTPError(400, "this model has no chat template: use /v1/completions")
    renders_tools = "tools" in tok.chat_template
    messages = [_message(m, None if renders_tools else parser) for m in req.messages]
    kwargs = template_kwargs(tok, req.chat_template_kwargs)
    if req.tool_mode() != "none":
        if renders_tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        else:  # tell the model about its tools, in its family's call format, in a system message of our own
            _add_system_note(messages, parser.instruction([
                {"name": t.function.name, "description": t.function.description or "",
                 "parameters": t.function.parameters or {}} for t in req.tools]))
        final = req.grammar().get("json_schema")
        if req.tool_mode() == "auto" and final is not None:  # the grammar takes a call or this: say when it is which
            _add_system_note(messages, "Call a tool while you still need its result. Once you have what you need, "
                             "reply instead with the final answer as a JSON object of this schema: " + final)
    continue_final = req.continue_final_message and messages[-1]["role"] == "assistant"
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not continue_final,
                                       continue_final_message=continue_final, **kwargs)
    except Exception as e:  # noqa: BLE001 - the template refuses these messages (raise_exception, bad roles)
        raise HTTPError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None
    if not isinstance(text, str):
        raise HTTPError(400, "the chat template did not render text")
    return text


def _add_system_note(messages: list[dict], note: str) -> None:
    if messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + note}
    else:
        messages.insert(0, {"role": "system", "content": note})


# apply_chat_template's own arguments: a client may not set them through chat_template_kwargs
# (its own template, tokenize=True returning ids, tools bypassing the tools field, ...)
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def template_kwargs(tok, given: dict[str, Any] | None) -> dict[str, Any]:
    """The chat_template_kwargs a template may see: the variables the model's own template reads
    (e.g. enable_thinking), JSON scalars only; others are dropped as vLLM does; apply_chat_template's
    own arguments are refused."""
    if not given:
        return {}
    reserved = sorted(k for k in given if k in _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise HTTPError(400, f"chat_template_kwargs may not set {', '.join(reserved)}")
    used = _template_variables(tok.chat_template) if isinstance(tok.chat_template, str) else frozenset()
    out = {}
    for k, v in given.items():
        if k not in used:
            continue
        if not isinstance(v, (str, int, float, bool)) and v is not None:
            raise HTTPError(400, f"chat_template_kwargs.{k} must be a string, number, boolean or null")
        out[k] = v
    return out


@functools.lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str]:
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return frozenset(meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(template)))


def _message(m, parser: ToolCallParser | None) -> dict:
    """A message for the template; `parser` (templates without tool support) writes past calls into content."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if not out["content"] and parser is not None:
            out["content"] = parser.render([(c.function.name, c.function.arguments) for c in m.tool_calls])
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


_NO_JSON = {"json_schema": None, "json_whitespace": None, "json_key_order": None}


def _constraint(req: ChatCompletionRequest, state: ServerState, inside: bool) -> dict:
    """What the request's constraint becomes (sampling_params keys over its own): tool grammars, and with a
    reasoning parser a JSON constraint that applies only after the reasoning block (a Lark grammar)."""
    token_id = functools.partial(_single_token, state.client)
    given = req.grammar()
    flexible = given.get("json_whitespace") == "flexible"
    forced = _tool_grammar(req, given, state.tool_parser, token_id, flexible)
    body = forced.pop("body", None)
    schema = forced.get("json_schema", given.get("json_schema"))
    reasoning = state.reasoning_parser
    if reasoning is not None and (body or schema):
        rules = body or json_body(schema, flexible)
        return {**_NO_JSON, "ebnf": after_reasoning(rules, reasoning.open, reasoning.close,
                                                    inside or reasoning.starts_inside, token_id)}
    if body:
        return {**_NO_JSON, "ebnf": "start: body\n" + body}
    return forced


def _tool_grammar(req: ChatCompletionRequest, given: dict, parser: ToolCallParser, token_id, flexible: bool) -> dict:
    """The json_schema constraint for tool_choice 'required' or a named function, and for tools in auto mode
    beside a json_schema response format a grammar of a call or the final object: in the family's own call
    format where a grammar can write it ("body": Lark rules), else JSON of either."""
    mode = tool_mode(req, parser)
    if mode == "either":
        return {"json_schema": either_schema(req.tools, given["json_schema"])}
    if mode == "auto" and given.get("json_schema") is not None:
        return {"body": either_grammar(req.tools, given["json_schema"], parser.call_tags, token_id, flexible)}
    if mode not in ("required", "named"):
        return {}
    if given:
        raise HTTPError(400, "tool_choice 'required' or a named function cannot be combined with "
                             "response_format, regex or ebnf")
    name = req.tool_choice.function.name if mode == "named" else None
    return {"json_schema": tool_call_schema(req.tools, mode, name, req.parallel_tool_calls is True)}


def _single_token(client: RuntimeClient, text: str) -> int | None:
    ids = client.tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def max_new_tokens(client: RuntimeClient, prompt_len: int, requested: int | None) -> int:
    room = client.limits.context_length - prompt_len
    if room <= 0:
        raise HTTPError(400, f"the prompt has {prompt_len} tokens; this model's context length is "
                             f"{client.limits.context_length}")
    if requested is None:
        return room
    if requested > room:
        raise HTTPError(400, f"max_tokens {requested} plus the prompt's {prompt_len} tokens exceeds the "
                             f"context length {client.limits.context_length}")
    return requested


def tokenized_request(client: RuntimeClient, ids: list[int], params: dict, top_logprobs: int | None,
                      stream: bool, lora: str | None = None) -> TokenizedGenerateReq:
    msg = TokenizedGenerateReq(f"oai-{uuid.uuid4().hex}", ids, SamplingParams.from_dict(params),
                               return_logprob=top_logprobs is not None, top_logprobs_num=top_logprobs or 0,
                               stream=stream, lora=lora)
    validate_request(msg, client.limits)
    return msg
