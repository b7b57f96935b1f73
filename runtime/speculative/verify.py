"""The model's picks over a draft of an unconstrained request, a chain or a tree (constrained ones go
through their grammar: GrammarManager.pick_verified, chains only).

Each position is sampled exactly as one decode step would sample it: the same sampler, penalties
over the tokens before the position, the request's own generator with one draw per position. The
draft is kept while the pick equals its token. So a kept token is precisely the token the step
would have drawn, and the first differing pick is a draw from the model's distribution given the
kept prefix: the output has the model's distribution (and, seeded, its very tokens) whatever was
drafted. A deterministic draft needs no acceptance ratio: its proposal probability is one. A tree
is walked the same way: at each node one draw, and the walk goes on into the child holding the
drawn token (the children of a node hold distinct tokens), so a tree only adds chances to keep.
"""

from __future__ import annotations

import torch

from plait.runtime.sampling import SampleRow, sample


def chain(n: int) -> list[int]:
    """The parents of a chain draft of n tokens (-1: the last sampled token)."""
    return list(range(-1, n - 1))


def walk_draft(req, rows: torch.Tensor, eos_ids: set[int], parents: list[int] | None = None
               ) -> tuple[list[int], int, list | None]:
    """The model's picks over a draft of an unconstrained request, from the last sampled token down the draft
    tree (`parents[i]`: the draft index node i follows, -1 for the last sampled token; None: a chain): at each
    node the pick is made as the sampler would make it one step at a time (penalties see the tokens before
    the node; one draw per pick from the request's generator), and the walk moves to the child holding the
    pick. rows[0]: logits at the last sampled token, rows[1 + i]: at draft node i.
    Returns (the draft nodes kept, in order; the next token; logprobs or None)."""
    draft, p = req.draft, req.params
    parents = chain(len(draft)) if parents is None else parents
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    base = len(req.output_ids) - len(draft)
    greedy = p.is_greedy and not req.return_logprob and not p.has_penalties and base >= p.min_new_tokens
    chosen = rows.argmax(-1).tolist() if greedy else None
    path: list[int] = []
    logprobs = []
    node = -1
    while True:
        if greedy:
            tok = chosen[node + 1]
        else:
            before = req.output_ids[:base] + [draft[i] for i in path]
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
        child = next((c for c in children.get(node, ()) if draft[c] == tok), None)
        if child is None:
            return path, tok, logprobs if req.return_logprob else None
        path.append(child)
        node = child
