"""The naive baseline for bench_programs: the same programs on plain transformers, one call at a
time, no prefix cache (every call recomputes its whole prompt), each choice scored by its own
forward. JSON-schema gens use xgrammar's logits processor for transformers, so both sides obey
the same grammar."""

from __future__ import annotations

import functools
import os
import threading

import torch

from plait.lang.backends.base import Backend, Call, choose
from plait.lang.chat_template import derive_roles


class TransformersBackend(Backend):
    def __init__(self, threads: int = 2):
        from transformers import AutoModelForCausalLM

        from plait.runtime.model_loader import load_tokenizer
        from plait.runtime.server_args import default_model_path

        torch.set_num_threads(threads)
        path = default_model_path()
        self.tokenizer = load_tokenizer(path)
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=torch.float32).eval()
        self.lock = threading.Lock()  # one call at a time
        self.calls = 0

    @functools.cached_property
    def _roles(self):
        tok = self.tokenizer
        return derive_roles(lambda m, gen: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen))

    def roles(self):
        return self._roles

    @torch.inference_mode()
    def generate(self, prompt, messages, params, on_delta, call: Call = Call()):
        ids = torch.tensor([self.tokenizer.encode(prompt)])
        kw = {"max_new_tokens": params.get("max_new_tokens", 128), "pad_token_id": self.tokenizer.eos_token_id}
        temp = params.get("temperature", 1.0)
        kw.update(do_sample=False) if temp == 0 else kw.update(do_sample=True, temperature=temp,
                                                                top_p=params.get("top_p", 1.0))
        if params.get("stop"):
            kw.update(stop_strings=params["stop"], tokenizer=self.tokenizer)
        if params.get("json_schema") or params.get("regex"):
            kw["logits_processor"] = [self._grammar(params)]
        with self.lock:
            self.calls += 1
            out = self.model.generate(ids, **kw)[0, ids.shape[1]:]
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        for s in params.get("stop") or []:
            text = text.split(s)[0]
        meta = {"prompt_tokens": ids.shape[1], "completion_tokens": len(out), "cached_tokens": 0}
        if on_delta:
            on_delta(text, meta)
        return text, meta

    def _grammar(self, params):
        import xgrammar as xgr
        from xgrammar.contrib.hf import LogitsProcessor

        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.model.config.vocab_size)
        compiler = xgr.GrammarCompiler(info)
        if params.get("json_schema"):
            g = compiler.compile_json_schema(params["json_schema"], any_whitespace=False)
        else:
            g = compiler.compile_regex(params["regex"])
        return LogitsProcessor(g)

    @torch.inference_mode()
    def select(self, prompt, messages, choices, method, temperature, call: Call = Call()):
        tok = self.tokenizer
        head = tok.encode(prompt)
        lps = []
        for c in choices:  # one forward per choice, the whole prompt each time
            full = tok.encode(prompt + c)
            start = next((i for i, (a, b) in enumerate(zip(head, full)) if a != b), min(len(head), len(full) - 1))
            start = max(start, 1)
            with self.lock:
                self.calls += 1
                logits = self.model(torch.tensor([full])).logits[0].float()
            logp = torch.log_softmax(logits[start - 1 : len(full) - 1], -1)
            lps.append(logp.gather(1, torch.tensor(full[start:])[:, None])[:, 0].tolist())
        return choose(method, lps)
