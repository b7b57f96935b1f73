"""Batched next-token sampling with penalties, filtering, per-request seeds and logprobs.

Each request draws one uniform number per step from its own torch.Generator and picks the
token by inverse CDF over its filtered distribution, so a seeded request samples the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.runtime.sampling.params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int]
    prompt_ids: list[int]
    banned_ids: list[int]  # ids masked this step (EOS / stop ids before min_new_tokens)
    want_logprob: bool
    top_logprobs_num: int


@dataclass
class SampleResult:
    next_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens
    top_logprobs: list[tuple[list[float], list[int]]] | None


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    b = logits.shape[0]
    if any(r.params.has_penalties for r in rows):
        logits = _apply_penalties(logits, rows)  # returns a new tensor
    banned = [(i, r.banned_ids) for i, r in enumerate(rows) if r.banned_ids]
    if banned:
        logits = logits.clone()
        for i, ids in banned:
            logits[i, ids] = float("-inf")

    want_lp = any(r.want_logprob for r in rows)
    logprobs_all = torch.log_softmax(logits, dim=-1) if want_lp else None

    greedy = [r.params.is_greedy for r in rows]
    if all(greedy):
        next_ids = torch.argmax(logits, dim=-1)
    else:
        next_ids = _sample_rows(logits, rows, greedy)

    chosen, tops = None, None
    if want_lp:
        chosen = logprobs_all.gather(1, next_ids.view(b, 1)).view(b).tolist()
        k = max(r.top_logprobs_num for r in rows)
        if k > 0:
            vals, idx = torch.topk(logprobs_all, k, dim=-1)
            tops = [(vals[i, : r.top_logprobs_num].tolist(), idx[i, : r.top_logprobs_num].tolist()) for i, r in enumerate(rows)]
    return SampleResult(next_ids.tolist(), chosen, tops)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    b, vocab = logits.shape
    counts = torch.zeros(b, vocab, dtype=logits.dtype)
    seen = torch.zeros(b, vocab, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r.output_ids:
            counts[i].index_add_(0, torch.tensor(r.output_ids), torch.ones(len(r.output_ids), dtype=logits.dtype))
        if r.params.repetition_penalty != 1:
            seen[i, r.prompt_ids] = True
    seen |= counts > 0
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype)[:, None]
    rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype)[:, None]
    logits = logits - freq * counts - pres * (counts > 0).to(logits.dtype)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    return torch.where(seen, penalised, logits)


def _sample_rows(logits: torch.Tensor, rows: list[SampleRow], greedy: list[bool]) -> torch.Tensor:
    temps = torch.tensor([1.0 if g else r.params.temperature for r, g in zip(rows, greedy)])[:, None]
    probs = torch.softmax(logits / temps, dim=-1)

    top_ks = [r.params.top_k for r in rows]
    if any(k > 0 for k in top_ks):
        vocab = probs.shape[1]
        ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks])  # clamped, as SGLang does
        kmax = int(ks.max())
        top_vals = torch.topk(probs, kmax, dim=-1).values
        kth = top_vals.gather(1, (ks - 1).clamp(max=kmax - 1).view(-1, 1))
        probs = torch.where(probs < kth, 0.0, probs)

    top_ps = torch.tensor([r.params.top_p for r in rows])
    if bool((top_ps < 1).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) > top_ps[:, None] * cum[:, -1:]  # keep the token that crosses p
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop_sorted, 0.0))

    min_ps = torch.tensor([r.params.min_p for r in rows])
    if bool((min_ps > 0).any()):
        probs = torch.where(probs < min_ps[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0, probs)

    u = torch.stack([torch.rand((), generator=r.generator, dtype=torch.float64) for r in rows])
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1]).view(-1, 1)
    picked = torch.searchsorted(cdf, target, right=True).view(-1).clamp(max=probs.shape[1] - 1)
    # a zero-probability token can only be picked by rounding at the boundary: step back to a kept one
    bad = probs.gather(1, picked.view(-1, 1)).view(-1) == 0
    if bool(bad.any()):
        picked = torch.where(bad, probs.argmax(-1), picked)
    if any(greedy):
        picked = torch.where(torch.tensor(greedy), logits.argmax(-1), picked)
    return picked
