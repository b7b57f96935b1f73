"""A request's result in the shape of SGLang's /generate response:
    {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "reasoning_tokens", "num_retractions",
     "weight_version", "e2e_latency", ["grammar_backend"], ["grammar_narrowed"],
     ["spec_verify_ct", "spec_accept_length"],
     [logprobs..., "output_token_logprobs_length"]}}

Streamed snapshots carry SGLang's split: output logprobs are the snapshot's own (its new
tokens), everything else (counts, input logprobs, output_token_logprobs_length) is cumulative.
"""

from __future__ import annotations

import time
from typing import Any

from plait.runtime.client.request import ReqState


def sglang_result(st: ReqState, tokenizer, delta_logprobs: bool = False) -> dict:
    """`st` as SGLang's /generate result; `delta_logprobs`: a stream snapshot's output logprobs are its own."""
    meta: dict[str, Any] = {
        "id": st.msg.rid,
        "finish_reason": st.finish.to_json() if st.finish else None,
        **st.counts,
        "weight_version": "default",  # SGLang's value while no weights were updated (plait cannot)
        "e2e_latency": time.perf_counter() - st.created,
    }
    if st.grammar_backend is not None:
        meta["grammar_backend"] = st.grammar_backend
    if st.grammar_narrowed:
        meta["grammar_narrowed"] = st.grammar_narrowed
    if st.spec[0]:  # SGLang's names: verify forwards, and tokens each yielded (kept draft + the next token)
        meta["spec_verify_ct"] = st.spec[0]
        meta["spec_accept_length"] = round(1 + st.spec[2] / st.spec[0], 4)
    if st.msg.return_logprob:
        def part(key: str, items: list) -> list:
            if not delta_logprobs or key.startswith("in_"):  # input logprobs are cumulative, as in SGLang
                return items
            start = st.sent[key]
            st.sent[key] = len(items)
            return items[start:]

        def lp(entry) -> list:
            text = tokenizer.decode([entry[1]]) if st.text_in_logprobs and tokenizer else None
            return [entry[0], entry[1], text]

        meta["input_token_logprobs"] = [lp(e) for e in part("in_lp", st.in_lp)]
        meta["output_token_logprobs"] = [lp(e) for e in part("out_lp", st.out_lp)]
        meta["output_token_logprobs_length"] = len(st.out_lp)
        if st.msg.top_logprobs_num:
            meta["input_top_logprobs"] = [None if t is None else [lp(e) for e in t]
                                          for t in part("in_top", st.in_top)]
            meta["output_top_logprobs"] = [[lp(e) for e in t] for t in part("out_top", st.out_top)]
    return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}
