"""Results rendered as OpenAI objects: completions and chat completions, whole or as stream chunks (text,
logprobs, tool calls and reasoning parsed out of the model's text, finish reasons, usage)."""


from __future__ import annotations

import time
import uuid
from typing import Any


from plait.runtime.entrypoints.common import (ServerState)
from plait.runtime.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from plait.runtime.client import ReqState
from plait.runtime.entrypoints.tool_calls import (either_parse, parse_constrained,
                                                  wire_call)
from plait.runtime.entrypoints.tool_calls import tool_mode
from plait.runtime.parsers import Call, ReasoningStream, ToolCallStream


def finish_reason(st: ReqState) -> str | None:
    if st.finish is None:
        return None
    return st.finish.type  # "stop" | "length" | "abort"


def _usage(states: list[ReqState], n: int) -> dict:
    # prompts count once per distinct prompt (n choices share one)
    prompt = sum(st.counts["prompt_tokens"] for st in states[::n])
    completion = sum(st.counts["completion_tokens"] for st in states)
    cached = sum(st.counts["cached_tokens"] for st in states[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class View:
    """Turns request states into OpenAI responses; remembers what each stream already sent."""

    def __init__(self, state: ServerState, req, states: list[ReqState]):
        self.tok = state.client.tokenizer
        self.model = req.model or state.model_name
        self.req = req
        self.states = states
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent_text = [0] * len(states)
        self.sent_lp = [0] * len(states)
        self.done = [False] * len(states)

    prefix = "cmpl"

    def _token(self, tid: int) -> str:
        return self.tok.decode([tid]) if self.tok is not None else str(tid)

    def _new_logprobs(self, i: int) -> tuple[list, list]:
        st = self.states[i]
        start = self.sent_lp[i]
        self.sent_lp[i] = len(st.out_lp)
        return st.out_lp[start:], st.out_top[start:]

    def chunk(self, snap: dict) -> list[dict]:
        """SSE payloads for one snapshot of choice snap["index"] (plus usage after the last)."""
        i = snap["index"]
        st = self.states[i]
        delta = st.text[self.sent_text[i]:]
        self.sent_text[i] = len(st.text)
        out = [self._chunk(i, delta, finish_reason(st))]
        if st.finish is not None:
            out += self._close(i)
        return out

    def _close(self, i: int) -> list[dict]:
        """Mark choice i done; after the last one, the usage chunk if the client asked for it."""
        self.done[i] = True
        if all(self.done) and self.req.stream_options and self.req.stream_options.include_usage:
            return [{"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                     "choices": [], "usage": _usage(self.states, self.req.n)}]
        return []


class CompletionView(View):
    chunk_object = "text_completion"

    def __init__(self, state, req: CompletionRequest, states, echo: list[str]):
        super().__init__(state, req, states)
        self.echo = echo
        self.echo_sent = [False] * len(states)

    def _logprobs(self, lps: list, tops: list, offset: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        tokens = [self._token(tid) for _, tid in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = [{self._token(tid): lp for lp, tid in t} for t in tops] if self.req.logprobs else None
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps], "top_logprobs": top,
                "text_offset": offsets}

    def final(self) -> dict:
        choices = []
        for i, st in enumerate(self.states):
            prefix = self.echo[i // self.req.n]
            choices.append({"index": i, "text": prefix + st.text,
                            "logprobs": self._logprobs(st.out_lp, st.out_top, len(prefix)),
                            "finish_reason": finish_reason(st)})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": _usage(self.states, self.req.n)}

    def _chunk(self, i: int, delta: str, finish: str | None) -> dict:
        if not self.echo_sent[i]:
            delta = self.echo[i // self.req.n] + delta
            self.echo_sent[i] = True
        lps, tops = self._new_logprobs(i)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": i, "text": delta, "logprobs": self._logprobs(lps, tops, 0),
                             "finish_reason": finish}]}


class ChatReply:
    """One chat choice's reply as it grows: reasoning split off, then calls split from content, by the request's
    mode. `feed` returns what to send now; a whole reply is one feed with final=True."""

    def __init__(self, view: "ChatView"):
        self.view = view
        self.reasoning = ReasoningStream(view.reasoning, view.inside) if view.reasoning else None
        self.tools = ToolCallStream(view.tool_parser, view.names) if view.tool_mode == "auto" else None
        self.sent = 0  # content characters sent (no tool parsing)
        self.calls_sent = 0  # calls returned so far

    def feed(self, text: str, final: bool) -> tuple[str, str, list[Call]]:
        """(reasoning, content, new calls) to send for the reply so far."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
            if text is None:
                return reasoning, "", []
        mode = self.view.tool_mode
        if self.tools is not None:
            content, calls = self.tools.feed(text, final)
        elif mode in ("required", "named"):
            # the grammar's JSON is never content: its complete calls, even where max_tokens cut the rest
            content, calls = "", parse_constrained(text)[self.calls_sent:]
        elif mode == "either":  # only the whole output tells a call from the final object
            if not final:
                return reasoning, "", []
            calls = either_parse(text, self.view.req.tools)
            content = "" if calls else text
        else:
            content, calls, self.sent = text[self.sent:], [], len(text)
        self.calls_sent += len(calls)
        return reasoning, content, calls

    @property
    def content_sent(self) -> int:
        """Characters of the reply's content sent so far."""
        return self.tools.sent if self.tools is not None else self.sent


class ChatView(View):
    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state, req: ChatCompletionRequest, states, inside: bool):
        super().__init__(state, req, states)
        self.role_sent = [False] * len(states)
        self.tool_mode = tool_mode(req, state.tool_parser)
        self.tool_parser, self.reasoning, self.inside = state.tool_parser, state.reasoning_parser, inside
        self.names = {t.function.name for t in req.tools or []}
        self.replies = [ChatReply(self) for _ in states]

    def message(self, st: ReqState) -> tuple[dict, str | None]:
        """The assistant message and finish reason, with reasoning and tool calls parsed out."""
        finish = finish_reason(st)
        if finish == "abort":
            return {"role": "assistant", "content": st.text}, finish
        reasoning, content, calls = ChatReply(self).feed(st.text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else content)}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if not calls:
            return message, finish
        return {**message, "tool_calls": [wire_call(c) for c in calls]}, "tool_calls"

    def _logprobs(self, lps: list, tops: list) -> dict | None:
        if not self.req.logprobs:
            return None

        def entry(lp: float, tid: int) -> dict:
            t = self._token(tid)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        content = []
        for (lp, tid), top in zip(lps, tops or [[]] * len(lps)):
            content.append({**entry(lp, tid), "top_logprobs": [entry(a, b) for a, b in top]})
        return {"content": content}

    def final(self) -> dict:
        choices = []
        for i, st in enumerate(self.states):
            message, finish = self.message(st)
            choices.append({"index": i, "message": message, "logprobs": self._logprobs(st.out_lp, st.out_top),
                            "finish_reason": finish})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": _usage(self.states, self.req.n)}

    def chunk(self, snap: dict) -> list[dict]:
        """Content and reasoning as they come (less only what could begin a call or end the reasoning), each
        call once it is complete, then the finish."""
        i = snap["index"]
        st = self.states[i]
        finish = finish_reason(st)
        reply = self.replies[i]
        if finish == "abort":
            reasoning, content, calls = "", st.text[reply.content_sent:], []
        else:
            reasoning, content, calls = reply.feed(st.text, final=finish is not None)
        lps, tops = self._new_logprobs(i)
        d: dict[str, Any] = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if content or (self.tool_mode == "none" and self.reasoning is None):
            d["content"] = content  # plain chat sends a chunk per step
        out = [self._delta(i, d, self._logprobs(lps, tops) if lps else None)] if d else []
        for k, call in enumerate(calls, start=reply.calls_sent - len(calls)):
            wire = wire_call(call)
            out.append(self._delta(i, {"tool_calls": [{"index": k, "id": wire["id"], "type": "function",
                                                       "function": {"name": call.name, "arguments": ""}}]}))
            out.append(self._delta(i, {"tool_calls": [{"index": k, "function": {
                "arguments": wire["function"]["arguments"]}}]}))
        if finish is not None:
            finish = "tool_calls" if reply.calls_sent and finish != "abort" else finish
            if out and "content" in out[-1]["choices"][0]["delta"] and not calls:
                out[-1]["choices"][0]["finish_reason"] = finish
            else:
                out.append(self._delta(i, {}, finish=finish))
            out += self._close(i)
        return out

    def _delta(self, i: int, d: dict, logprobs: dict | None = None, finish: str | None = None) -> dict:
        if not self.role_sent[i]:
            d = {"role": "assistant", **d}
            self.role_sent[i] = True
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": i, "delta": d, "logprobs": logprobs, "finish_reason": finish}]}
