"""Jump-forward decoding, verified: the grammar drafts, the model checks.

Where the grammar admits exactly one continuation (keys, punctuation, enum prefixes), that
text is tokenized the way the tokenizer would (not one token per character) and appended as a
draft. The next forward computes the draft in one extend and yields logits at every draft
position; each position is sampled under its grammar mask, and the draft is kept up to the
first token the model would not have chosen. So the output is exactly what token-by-token
constrained decoding gives at temperature 0 (and a correct sample at any temperature), while
the forced stretches cost one forward instead of one per token. Rejected draft tokens leave
only KV slots that the next tokens overwrite; nothing reaches the radix cache before the check.
"""

from __future__ import annotations

from plait.runtime.constrained.base import Matcher

MAX_DRAFT = 32


def plan_draft(matcher: Matcher, tokenizer, room: int) -> list[int]:
    """Token ids of the grammar's forced continuation (at most `room`), checked against the
    matcher, which is left unchanged. [] when there is nothing forced. A token that ends the grammar
    is left to the model's own pick after the draft, so a request ends on the same token either way."""
    if room <= 0:
        return []
    ids = matcher.forced_tokens()
    if ids is None:
        forced = matcher.jump_forward_string()
        if not forced:
            return []
        ids = tokenizer.encode(forced, add_special_tokens=False)
    ids = ids[: min(room, MAX_DRAFT)]
    return ids[: allowed_prefix(matcher, ids, before_end=True)]


def allowed_prefix(matcher: Matcher, ids: list[int], before_end: bool = False) -> int:
    """How many leading `ids` the matcher accepts in a row (it is left unchanged); with `before_end`, none that
    ends the grammar (a verify has no row to pick from after the end: the model picks the end itself)."""
    accepted = 0
    for t in ids:
        if not matcher.accept_token(t):
            break
        accepted += 1
        if before_end and matcher.is_terminated():
            matcher.rollback(1)
            accepted -= 1
            break
    matcher.rollback(accepted)
    return accepted

