"""The model's picks over a draft of an unconstrained request (constrained ones go through their
grammar: GrammarManager.pick_verified).

Each position is sampled exactly as one decode step would sample it: the same sampler, penalties
over the tokens before the position, the request's own generator with one draw per position. The
draft is kept while the pick equals its token. So a kept token is precisely the token the step
would have drawn, and the first differing pick is a draw from the model's distribution given the
kept prefix: the output has the model's distribution (and, seeded, its very tokens) whatever was
drafted. A deterministic draft needs no acceptance ratio: its proposal probability is one.
"""

from __future__ import annotations

import torch

from plait.runtime.constrained.jump_forward import accepted_prefix
from plait.runtime.sampling import SampleRow, sample


def walk_draft(req, rows: torch.Tensor, eos_ids: set[int]) -> tuple[int, int, list | None]:
    """The model's picks over a draft of an unconstrained request, position by position as the
    sampler would pick them one step at a time (penalties see the tokens before the position; one
    draw per position from the request's generator). Returns (kept, next token, logprobs or None)."""
    draft, p = req.draft, req.params
    base = len(req.output_ids) - len(draft)
    if p.is_greedy and not req.return_logprob and not p.has_penalties and base >= p.min_new_tokens:
        chosen = rows.argmax(-1).tolist()
        kept = accepted_prefix(draft, chosen)
        return kept, chosen[kept], None
    logprobs = []
    for i in range(len(draft) + 1):
        before = req.output_ids[: base + i]
        banned = []
        if len(before) < p.min_new_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_ids))
        row = SampleRow(p, req.generator, before, req.origin_input_ids, banned, req.return_logprob,
                        req.top_logprobs_num if req.return_logprob else 0)
        one = sample(rows[i : i + 1], [row])
        tok = one.next_ids[0]
        if req.return_logprob:
            top = list(zip(*one.top_logprobs[0])) if one.top_logprobs else None
            logprobs.append(((one.logprobs[0], tok), top))
        if i == len(draft) or tok != draft[i]:
            return i, tok, logprobs if req.return_logprob else None
    raise AssertionError("unreachable: the last row always ends the walk")
