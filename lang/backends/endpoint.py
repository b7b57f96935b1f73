"""RuntimeEndpoint: a plait (or SGLang) server over its native HTTP API."""

from __future__ import annotations

import functools
import json

import httpx

from plait.lang.backends.base import Backend, Call, OnDelta, choose, gather_stream, unconditional_context
from plait.lang.chat_template import CHATML, ChatRoles, derive_roles, jinja_render


class RuntimeEndpoint(Backend):
    support_concate_and_append = True

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.model_info = self._get("/get_model_info")

    def _get(self, path: str) -> dict:
        r = self.client.get(path)
        self._check(r)
        return r.json()

    def _post(self, body: dict, path: str = "/generate"):
        r = self.client.post(path, json=body)
        self._check(r)
        return r.json()

    @staticmethod
    def _check(r: httpx.Response) -> None:
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text
            raise ValueError(f"server answered {r.status_code}: {msg}") if r.status_code < 500 else \
                RuntimeError(f"server answered {r.status_code}: {msg}")

    @functools.cached_property
    def _roles(self) -> ChatRoles:
        # the server's own template (plait's /get_model_info has it); ChatML if the server has none
        return derive_roles(jinja_render(self.model_info.get("chat_template") or CHATML))

    def roles(self) -> ChatRoles:
        return self._roles

    def generate(self, prompt, messages, params, on_delta: OnDelta, call: Call = Call()):
        body = {"text": prompt, "sampling_params": params, **call.native_fields()}
        if on_delta is None:
            out = self._post(body)
            text, meta = out["text"], out["meta_info"]
        else:
            text, meta = gather_stream(self._snapshots({**body, "stream": True}), on_delta, call)
        self.token_usage.add(meta)
        return text, meta

    def _snapshots(self, body: dict):
        """A streamed /generate's events, parsed."""
        with self.client.stream("POST", "/generate", json=body) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                snap = json.loads(line[6:])
                if "error" in snap:
                    raise ValueError(snap["error"]["message"])
                yield snap

    def _choice_logprobs(self, context: str, choices: list[str], call: Call) -> list[list[float]]:
        joins = {**call.join_fields(), **call.lora_fields()}
        # the context alone first: its length, its last token, and it lands in the prefix cache
        head = self._post({"text": context, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                           "logprob_start_len": 0, **joins})
        n_context = head["meta_info"]["prompt_tokens"]
        last_id = head["meta_info"]["input_token_logprobs"][-1][1]
        outs = self._post({"text": [context + c for c in choices], "sampling_params": {"max_new_tokens": 0},
                           "return_logprob": True, "logprob_start_len": max(n_context - 1, 0), **joins})
        self.token_usage.add(head["meta_info"])
        for o in outs:
            self.token_usage.add(o["meta_info"])
        lps = []
        for o in outs:
            entries = o["meta_info"]["input_token_logprobs"]
            # position n_context-1 is still the context's last token unless the choice merged into it
            if len(entries) > 1 and entries[0][1] == last_id:
                entries = entries[1:]
            lps.append([e[0] for e in entries if e[0] is not None])
        return lps

    def select(self, prompt, messages, choices, method, temperature, call: Call = Call()):
        lps = self._choice_logprobs(prompt, choices, call)
        unc = None
        if method == "unconditional_likelihood_normalized":
            unc = self._choice_logprobs(unconditional_context(prompt), choices, Call())
        return choose(method, lps, unc)

    def embed(self, texts: list[str], model: str | None = None) -> list[list[float]]:
        out = self._post({"input": texts, **({"model": model} if model else {})}, "/v1/embeddings")
        return [d["embedding"] for d in sorted(out["data"], key=lambda d: d["index"])]

    def cache_prefix(self, prompt: str, call: Call = Call()) -> None:
        self._post({"text": prompt, "sampling_params": {"max_new_tokens": 0}, **call.join_fields(),
                    **call.lora_fields()})

    def join_kv(self, fork_text: str, branch_texts: list[str], call: Call = Call()) -> dict | None:
        out = self._post({"fork_text": fork_text, "branch_texts": branch_texts, **call.join_fields()}, "/join_kv")
        return out if out.get("join_id") else None

    def get_model_name(self) -> str:
        return self.model_info["model_path"]

    def get_server_info(self) -> dict:
        return self._get("/server_info")

    def flush_cache(self) -> bool:
        r = self.client.post("/flush_cache")
        return r.status_code == 200

    def shutdown(self) -> None:
        self.client.close()
