"""OpenAI: programs on a chat-completions server, where the API allows it.

`gen` must sit at the start of an `assistant(...)` turn (the API cannot continue a partial
message); `select` takes the next token's top logprobs and scores each choice by the best
token that starts it, so the choices must differ in their first tokens. Anything else raises.
"""

from __future__ import annotations

from plait.lang.backends.base import Backend, Call, OnDelta
from plait.lang.chat_template import CHATML, ChatRoles, derive_roles, jinja_render


class OpenAI(Backend):
    is_chat_model = True

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, **client_kwargs):
        import openai

        self.model = model
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", **client_kwargs)
        self._roles = derive_roles(jinja_render(CHATML))  # for s.text() only; the server applies its own

    def roles(self) -> ChatRoles:
        return self._roles

    def _messages(self, messages: list[dict], what: str) -> list[dict]:
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError(f"the OpenAI backend can only {what} at the start of an assistant turn")
        if messages[-1]["content"]:
            raise ValueError(f"the OpenAI backend cannot {what} after text inside an assistant turn")
        return messages[:-1]

    def generate(self, prompt, messages, params, on_delta: OnDelta, call: Call = Call()):
        msgs = self._messages(messages, "gen")
        for key in ("regex", "ebnf", "min_new_tokens"):
            if params.get(key):
                raise ValueError(f"the OpenAI backend does not support {key}")
        kw = {"model": self.model, "messages": msgs, "max_tokens": params.get("max_new_tokens", 128),
              "temperature": params.get("temperature", 1.0), "top_p": params.get("top_p", 1.0),
              "stop": params.get("stop") or None, "frequency_penalty": params.get("frequency_penalty", 0.0),
              "presence_penalty": params.get("presence_penalty", 0.0)}
        if params.get("json_schema"):
            import json

            kw["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": json.loads(params["json_schema"])}}
        if call.return_logprob:
            kw.update(logprobs=True, top_logprobs=call.top_logprobs_num or None)
        r = self.client.chat.completions.create(**kw)
        choice = r.choices[0]
        text = choice.message.content or ""
        meta = {"finish_reason": {"type": choice.finish_reason}, "prompt_tokens": r.usage.prompt_tokens,
                "completion_tokens": r.usage.completion_tokens}
        if call.return_logprob and choice.logprobs:
            meta["output_token_logprobs"] = [[t.logprob, None, t.token] for t in choice.logprobs.content]
        if on_delta is not None and text:
            on_delta(text, meta)
        self.token_usage.add(meta)
        return text, meta

    def select(self, prompt, messages, choices, method, temperature, call: Call = Call()):
        msgs = self._messages(messages, "select")
        r = self.client.chat.completions.create(model=self.model, messages=msgs, max_tokens=1, temperature=0,
                                                logprobs=True, top_logprobs=20)
        top = r.choices[0].logprobs.content[0].top_logprobs
        scores = []
        for c in choices:
            matches = [t.logprob for t in top if t.token and (c.startswith(t.token) or t.token.startswith(c))]
            scores.append(max(matches) if matches else float("-inf"))
        if all(s == float("-inf") for s in scores):
            raise ValueError("the OpenAI backend could not score any choice from the top-20 first tokens; "
                             "use choices that start differently, or a plait backend")
        index = max(range(len(choices)), key=lambda i: scores[i])
        self.token_usage.add({"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens})
        return index, {"scores": scores, "method": "first_token_logprob"}

    def embed(self, texts: list[str], model: str | None = None) -> list[list[float]]:
        res = self.client.embeddings.create(model=model or self.model, input=texts, encoding_format="float")
        return [d.embedding for d in sorted(res.data, key=lambda d: d.index)]

    def get_model_name(self) -> str:
        return self.model
