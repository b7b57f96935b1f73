"""The OpenAI Responses API: POST /v1/responses (plain, streamed as typed events, or in the background),
GET /v1/responses/{id} (+ /input_items), POST /v1/responses/{id}/cancel, DELETE /v1/responses/{id}.

A request becomes a chat request (instructions as the system message, input items as messages, function
calls and their outputs as tool calls and tool messages) and runs through the chat path: the same template,
tool grammar, parsers and sampling. A stored response keeps its conversation, so `previous_response_id`
continues it; the new prompt begins with the old one's tokens and the radix cache computes only the new turn.
Stored responses live in this process's memory, the oldest dropped past `_STORE_SIZE`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from plait.runtime.entrypoints.common import (HTTPError, ServerState, constrained, first_or_disconnect, server_state,
                                              started)
from plait.runtime.entrypoints.openai_api import body_doc, chat_requests, parse_body
from plait.runtime.entrypoints.openai_render import ChatReply, ChatView, finish_reason
from plait.runtime.entrypoints.openai_protocol import ChatCompletionRequest, InputItem, ResponsesRequest
from plait.runtime.entrypoints.tool_calls import wire_call
from plait.runtime.client import ReqState

_STORE_SIZE = 1024  # stored responses kept (the oldest dropped first)
_EXTRAS = {"top_k", "min_p", "repetition_penalty", "stop", "ignore_eos", "regex", "ebnf"}  # passed on to chat


@dataclass
class _Stored:
    response: dict
    input_items: list[dict]
    history: list[dict]  # the conversation through this response, as chat messages (no instructions)
    task: asyncio.Task | None = None  # a background response still running
    states: list[ReqState] = field(default_factory=list)


class _Store:
    def __init__(self) -> None:
        self.items: OrderedDict[str, _Stored] = OrderedDict()

    def put(self, stored: _Stored) -> None:
        self.items[stored.response["id"]] = stored
        while len(self.items) > _STORE_SIZE:
            self.items.popitem(last=False)

    def get(self, rid: str, what: str = "Response") -> _Stored:
        if rid not in self.items:
            raise HTTPError(404, f"{what} with id '{rid[:80]}' not found.")
        return self.items[rid]


router = APIRouter()


def _store(state: ServerState) -> "_Store":
    """The app's stored responses (made on first use)."""
    if state.responses is None:
        state.responses = _Store()
    return state.responses


@router.post("/v1/responses", openapi_extra=body_doc(ResponsesRequest))
async def create(request: Request, state: ServerState = Depends(server_state)):
    store = _store(state)
    req = await parse_body(request, ResponsesRequest, state)
    history = store.get(req.previous_response_id, "Previous response").history if req.previous_response_id \
        else []
    turn = _turn_messages(req)
    chat = _chat_request(req, history + turn)
    msgs, inside = await asyncio.to_thread(chat_requests, state, chat)
    states = state.client.submit(msgs)
    run = _Run(state, req, chat, states, inside)
    stored = _Stored(run.response("in_progress" if not req.background else "queued"),
                     _input_items(req), history + turn, states=states) if req.store else None
    gen = state.client.results(states, req.stream, single=False)
    if stored is not None:
        store.put(stored)  # retrievable while it runs
    if req.background:
        stored.task = asyncio.ensure_future(_finish_in_background(state, run, gen, stored, store))
        return JSONResponse(stored.response)
    if req.stream:
        if constrained(msgs):
            gen = await started(request, state.client, gen)
        return StreamingResponse(_events(request, run, gen, store, stored), media_type="text/event-stream")
    try:
        await first_or_disconnect(request, state.client, gen)
    except Exception:
        if stored is not None:
            stored.response = run.response("failed")
        raise
    _settle(run, stored, store)
    return JSONResponse(run.response())

@router.get("/v1/responses/{rid}")
async def retrieve(rid: str, state: ServerState = Depends(server_state)):
    store = _store(state)
    return store.get(rid).response

@router.get("/v1/responses/{rid}/input_items")
async def input_items(rid: str, state: ServerState = Depends(server_state)):
    store = _store(state)
    items = store.get(rid).input_items
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}

@router.post("/v1/responses/{rid}/cancel")
async def cancel(rid: str, state: ServerState = Depends(server_state)):
    store = _store(state)
    stored = store.get(rid)
    if not stored.response.get("background"):
        raise HTTPError(400, "Only responses created with background=true can be cancelled.")
    if stored.task is not None and not stored.task.done():
        stored.task.cancel()  # closing its generator aborts its requests
        try:
            await stored.task
        except asyncio.CancelledError:
            pass
        stored.response = {**stored.response, "status": "cancelled"}
    return stored.response

@router.delete("/v1/responses/{rid}")
async def delete(rid: str, state: ServerState = Depends(server_state)):
    store = _store(state)
    stored = store.get(rid)
    if stored.task is not None and not stored.task.done():
        stored.task.cancel()
    del store.items[rid]
    return {"id": rid, "object": "response.deleted", "deleted": True}


# ---- request ------------------------------------------------------------------------------------------------
def _turn_messages(req: ResponsesRequest) -> list[dict]:
    """This request's input as chat messages: function calls in a row join one assistant message."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for item in req.input:
        if item.type == "message":
            out.append({"role": item.role, "content": _text(item.content)})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                        "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    if not out:
        raise HTTPError(400, "input holds no message (reasoning items alone are not a turn)")
    return out


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text or "" for p in content)


def _chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
                            "parallel_tool_calls": req.parallel_tool_calls}
    body.update(req.model_dump(include=_EXTRAS, exclude_none=True))
    if req.instructions:
        body["messages"] = [{"role": "system", "content": req.instructions}, *messages]
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
        choice = req.tool_choice
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
            if choice is not None and not isinstance(choice, str) else choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None


def _input_items(req: ResponsesRequest) -> list[dict]:
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        if isinstance(d.get("content"), str):
            d["content"] = [{"type": "input_text", "text": d["content"]}]
        out.append({"id": f"msg_{uuid.uuid4().hex}", **d})
    return out


# ---- the response object -----------------------------------------------------------------------------------
class _Run:
    """One response being generated: its output items so far, and the events a stream sends as it grows."""

    def __init__(self, state: ServerState, req: ResponsesRequest, chat: ChatCompletionRequest,
                 states: list[ReqState], inside: bool):
        self.req, self.states = req, states
        self.view = ChatView(state, chat, states, inside)
        self.reply = ChatReply(self.view)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = req.model or state.model_name
        self.items: list[dict] = []  # output items (open ones have status "in_progress")
        self.open_text: dict | None = None  # the message item text is being added to
        self.open_reasoning: dict | None = None
        self.seq = 0
        self.status: str | None = None

    def response(self, status: str | None = None) -> dict:
        req, st = self.req, self.states[0]
        status = status or self.status or "in_progress"
        usage = None
        if st.finish is not None:
            prompt, done = st.counts["prompt_tokens"], st.counts["completion_tokens"]
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": st.counts["cached_tokens"]},
                     "output_tokens": done, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + done}
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
            {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": req.background, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": self.items, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt}, "tool_choice": _choice(req),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": usage,
            "user": req.user, "metadata": req.metadata or {}}

    def advance(self) -> list[dict]:
        """Events for what the reply added since the last call (all of it, for a whole reply)."""
        st = self.states[0]
        final = st.finish is not None
        events: list[dict] = []
        if finish_reason(st) == "abort":
            reasoning, content, calls = "", "", []
        else:
            reasoning, content, calls = self.reply.feed(st.text, final)
        if reasoning:
            events += self._add_reasoning(reasoning)
        if content:
            events += self._close_reasoning() + self._add_text(content)
        for call in calls:
            events += self._close_reasoning() + self._close_text() + self._add_call(call)
        if final:
            events += self._close_reasoning() + self._close_text()
            finish = finish_reason(st)
            self.status = {"length": "incomplete", "abort": "cancelled"}.get(finish, "completed")
            if any(i["type"] == "function_call" for i in self.items):
                self.status = "completed"
        return events

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _open(self, item: dict) -> dict:
        self.items.append(item)
        return self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def _add_text(self, delta: str) -> list[dict]:
        events = []
        if self.open_text is None:
            self.open_text = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                              "role": "assistant", "content": []}
            events.append(self._open(self.open_text))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.open_text["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=self.open_text["id"],
                                      output_index=len(self.items) - 1, content_index=0, part=dict(part)))
        self.open_text["content"][0]["text"] += delta
        return events + [self.event("response.output_text.delta", item_id=self.open_text["id"],
                                     output_index=self.items.index(self.open_text), content_index=0, delta=delta,
                                     logprobs=[])]

    def _close_text(self) -> list[dict]:
        item, self.open_text = self.open_text, None
        if item is None:
            return []
        item["status"] = "completed"
        index, part = self.items.index(item), item["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index,
                            content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    def _add_reasoning(self, delta: str) -> list[dict]:
        events = []
        if self.open_reasoning is None:
            self.open_reasoning = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress",
                                   "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}
            events.append(self._open(self.open_reasoning))
        self.open_reasoning["content"][0]["text"] += delta
        return events + [self.event("response.reasoning_text.delta", item_id=self.open_reasoning["id"],
                                     output_index=self.items.index(self.open_reasoning), content_index=0,
                                     delta=delta)]

    def _close_reasoning(self) -> list[dict]:
        item, self.open_reasoning = self.open_reasoning, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self.items.index(item)
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=item["content"][0]["text"]),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    def _add_call(self, call) -> list[dict]:
        wire = wire_call(call)
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": wire["id"], "name": call.name, "arguments": ""}
        events = [self._open(item)]
        index, args = len(self.items) - 1, wire["function"]["arguments"]
        item.update(arguments=args, status="completed")
        return events + [
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=args),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=call.name, arguments=args),
            self.event("response.output_item.done", output_index=index, item=dict(item))]

    def assistant_message(self) -> dict:
        """The output as a chat message, for the conversation a later response continues."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def _choice(req: ResponsesRequest):
    c = req.tool_choice
    return c.model_dump() if c is not None and not isinstance(c, str) else (c or "auto")


def _settle(run: _Run, stored: _Stored | None, store: _Store) -> None:
    """A finished run: its output items whole, and (when stored) the response and its conversation kept."""
    if run.status is None:
        run.advance()
    if stored is not None:
        stored.response = run.response()
        stored.history = [*stored.history, run.assistant_message()]
        stored.task = None
        store.put(stored)


async def _events(request: Request, run: _Run, gen: AsyncIterator[dict], store: _Store,
                  stored: _Stored | None) -> AsyncIterator[bytes]:
    """SSE: response.created, .in_progress, the items' events as the reply grows, then .completed (or
    .incomplete / .failed)."""

    def sse(event: dict) -> bytes:
        return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"

    yield sse(run.event("response.created", response=run.response("in_progress")))
    yield sse(run.event("response.in_progress", response=run.response("in_progress")))
    try:
        async for _ in gen:
            for event in run.advance():
                yield sse(event)
            if run.status is not None:
                break
    except Exception as e:  # noqa: BLE001 - a refusal or dead runtime after the stream began ends it as failed
        failed = {**run.response("failed"), "error": {"code": "server_error", "message": str(e)}}
        yield sse(run.event("response.failed", response=failed))
        return
    finally:
        await gen.aclose()  # a client that left aborts what is unfinished
        if run.status is None and stored is not None:
            stored.response = run.response("cancelled")
            store.put(stored)
    _settle(run, stored, store)
    kind = {"incomplete": "response.incomplete", "cancelled": "response.failed"}.get(run.status, "response.completed")
    yield sse(run.event(kind, response=run.response()))


async def _finish_in_background(state: ServerState, run: _Run, gen: AsyncIterator[dict], stored: _Stored,
                                store: _Store) -> None:
    stored.response = run.response("in_progress")
    try:
        await state.client.first(gen)
    except asyncio.CancelledError:
        await gen.aclose()
        raise
    except Exception as e:  # noqa: BLE001 - kept as the stored response's error
        stored.response = {**run.response("failed"), "error": {"code": "server_error", "message": str(e)}}
        stored.task = None
        return
    _settle(run, stored, store)
