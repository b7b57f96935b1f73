"""Sampling a batch's next tokens: one row per request (its params, penalties, banned tokens, generator), drawn
in one batched call; a row that makes the call raise fails its request alone."""

from __future__ import annotations

import torch

from plait.runtime.sampling import SampleRow, sample
from plait.runtime.sampling.sampler import SampleResult
from plait.runtime.scheduler.faults import fail_request
from plait.runtime.scheduler.req import Req


def sample_rows(reqs: list[Req], eos_ids: set[int]) -> list[SampleRow]:
    rows = []
    for req in reqs:
        p = req.params
        banned = []
        if req.output_len < p.min_new_tokens and req.matcher is None:  # a grammar decides where it ends
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_ids))
        rows.append(SampleRow(p, req.generator, req.output_ids, req.origin_input_ids, banned,
                              req.return_logprob, req.top_logprobs_num if req.return_logprob else 0))
    return rows


def sample_isolated(logits: torch.Tensor, rows: list[SampleRow], reqs: list[Req]) -> SampleResult:
    """One batched sample; if it raises, sample row by row to find the culprit and fail only it
    (each row draws from its own generator, so the others pick what the batch would have)."""
    try:
        return sample(logits, rows)
    except Exception:  # noqa: BLE001
        pass
    ids, lps, tops = [], [], []
    want = any(r.want_logprob for r in rows)
    for k, (row, req) in enumerate(zip(rows, reqs)):
        try:
            one = sample(logits[k : k + 1], [row])
        except Exception as e:  # noqa: BLE001
            fail_request(req, "sampling", e)
            one = SampleResult([0], [0.0] if want else None, [([], [])] if want else None)
        ids.append(one.next_ids[0])
        lps.append(one.logprobs[0] if one.logprobs else 0.0)
        tops.append(one.top_logprobs[0] if one.top_logprobs else ([], []))
    return SampleResult(ids, lps if want else None, tops if want else None)
