"""Verifying a draft: one walk down it, whatever picks the tokens.

`walk` goes from the last committed token down the draft (a chain, or a tree of distinct children), asking a
picker for the model's token at each node and moving into the child that holds it; the first node without one
ends the walk, and its pick is the next token. Who picks differs, the walk does not: `sampler_picks` here for an
unconstrained request (the sampler as one decode step would call it, penalties over the tokens before the node),
and GrammarManager's picks for a constrained one (under the grammar's masks, filled up front or lazily).

Each position is picked exactly as one decode step would pick it: the same sampler, the request's own generator
with one draw per position. So a kept token is precisely the token the step would have drawn, and the first
differing pick is a draw from the model's distribution given the kept prefix: the output has the model's
distribution (and, seeded, its very tokens) whatever was drafted. A deterministic draft needs no acceptance
ratio: its proposal probability is one. In a tree each node is one draw and the walk goes on into the child
holding it (the children of a node hold distinct tokens), so a tree only adds chances to keep.
"""

from __future__ import annotations

from typing import Callable

import torch

from plait.runtime.sampling import SampleRow, sample

# the model's pick at a draft node (-1: the last committed token), given the kept nodes before it
Pick = Callable[[int, list[int]], int]


def chain(n: int) -> list[int]:
    """The parents of a chain draft of n tokens (-1: the last sampled token)."""
    return list(range(-1, n - 1))


def walk(draft: list[int], parents: list[int] | None, pick: Pick) -> tuple[list[int], int]:
    """Down the draft (`parents[i]`: the node node i follows, -1 for the last committed token; None: a chain)
    while the picks match a child's token. Returns (the draft nodes kept, in order; the next token)."""
    parents = chain(len(draft)) if parents is None else parents
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    path: list[int] = []
    node = -1
    while True:
        tok = pick(node, path)
        child = next((c for c in children.get(node, ()) if draft[c] == tok), None)
        if child is None:
            return path, tok
        path.append(child)
        node = child


def sampler_picks(req, rows: torch.Tensor, eos_ids: set[int], logprobs: list) -> Pick:
    """An unconstrained request's picks: rows[0] holds the logits at the last committed token, rows[1 + i] at
    draft node i; each pick as the sampler makes it one step at a time (penalties and min_new_tokens see the
    tokens before the node; one draw per pick from the request's generator). With return_logprob each pick's
    ((logprob, token), top) is appended to `logprobs`."""
    draft, p = req.draft.tokens, req.params
    greedy = p.is_greedy and not req.return_logprob and not p.has_penalties and len(req.output_ids) >= p.min_new_tokens
    chosen = rows.argmax(-1).tolist() if greedy else None

    def pick(node: int, path: list[int]) -> int:
        if chosen is not None:
            return chosen[node + 1]
        before = req.output_ids + [draft[i] for i in path]
        banned = []
        if len(before) < p.min_new_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_ids))
        row = SampleRow(p, req.generator, before, req.origin_input_ids, banned, req.return_logprob,
                        req.top_logprobs_num if req.return_logprob else 0)
        one = sample(rows[node + 1 : node + 2], [row])
        tok = one.next_ids[0]
        if req.return_logprob:
            top = list(zip(*one.top_logprobs[0])) if one.top_logprobs else None
            logprobs.append(((one.logprobs[0], tok), top))
        return tok

    return pick
