"""Runtime: starts plait's runtime processes and talks to them over ZMQ (no HTTP in between)."""

from __future__ import annotations

import functools
import os

from plait.lang.backends.base import Backend, Call, OnDelta, choose, gather_stream, unconditional_context
from plait.lang.chat_template import ChatRoles, derive_roles


class Runtime(Backend):
    """`Runtime(model_path=None, **server_args)`: the same runtime `plait serve` runs, in child
    processes of this one. `shutdown()` stops them."""

    support_concate_and_append = True

    def __init__(self, model_path: str | None = None, **server_args):
        from plait.runtime.entrypoints.engine import Engine

        self.engine = Engine(model_path, **server_args)
        self.tokenizer = self.engine.tokenizer

    @functools.cached_property
    def _roles(self) -> ChatRoles:
        tok = self.tokenizer
        return derive_roles(lambda m, gen: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen))

    def roles(self) -> ChatRoles:
        return self._roles

    def generate(self, prompt, messages, params, on_delta: OnDelta, call: Call = Call()):
        kw = call.native_fields()
        if on_delta is None:
            out = self.engine.generate(prompt, params, **kw)
            text, meta = out["text"], out["meta_info"]
        else:
            text, meta = gather_stream(self.engine.generate(prompt, params, stream=True, **kw), on_delta, call)
        self.token_usage.add(meta)
        return text, meta

    def _choice_ids(self, context: str, choices: list[str]) -> tuple[list[list[int]], list[int]]:
        """Token ids of context+choice and where the choice's tokens start (boundary merges included)."""
        tok = self.tokenizer
        head = tok.encode(context)
        ids, starts = [], []
        for c in choices:
            full = tok.encode(context + c)
            ids.append(full)
            starts.append(max(min(len(os.path.commonprefix([head, full])), len(full) - 1), 1))
        return ids, starts

    def select(self, prompt, messages, choices, method, temperature, call: Call = Call()):
        ids, starts = self._choice_ids(prompt, choices)
        if method == "unconditional_likelihood_normalized":
            more, more_starts = self._choice_ids(unconditional_context(prompt), choices)
            ids, starts = ids + more, starts + more_starts
        # one batched prefill-only call scores every choice (the shared prompt is computed once)
        outs = self.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                    logprob_start_len=starts, **call.join_fields(), **call.lora_fields())
        lps = [[e[0] for e in o["meta_info"]["input_token_logprobs"] if e[0] is not None] for o in outs]
        n = len(choices)
        index, meta = choose(method, lps[:n], lps[n:] if len(lps) > n else None)
        meta["prompt_tokens"] = sum(o["meta_info"]["prompt_tokens"] for o in outs)
        meta["cached_tokens"] = sum(o["meta_info"]["cached_tokens"] for o in outs)
        self.token_usage.add(meta)
        return index, meta

    def embed(self, texts: list[str], model: str | None = None) -> list[list[float]]:
        return self.engine.embed(texts, model=model)

    def cache_prefix(self, prompt: str, call: Call = Call()) -> None:
        self.engine.generate(prompt, {"max_new_tokens": 0}, **call.join_fields(), **call.lora_fields())

    def join_kv(self, fork_text: str, branch_texts: list[str], call: Call = Call()) -> dict | None:
        return self.engine.join_kv(fork_text, branch_texts, **call.join_fields())

    def get_model_name(self) -> str:
        return self.engine.args.model_path

    def get_tokenizer(self):
        return self.tokenizer

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()
