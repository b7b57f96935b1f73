"""NGRAM drafts (prompt lookup): no model, only the request's own tokens.

Where the last few tokens of a sequence occurred before in it (the prompt or the output so far), what
followed them then is proposed as the draft: summaries, code edits, JSON that repeats its keys and
quoted text all copy long runs. The longest suffix that matches wins (from `max_ngram` tokens down
to `min_ngram`), and among its occurrences the latest. An index of every n-gram's last end keeps
the lookup O(1) per token; it grows as tokens arrive.
"""

from __future__ import annotations

from plait.runtime.speculative.drafter import Draft, DraftStep, Proposal, register


@register("NGRAM")
class NgramDrafter:
    """A guess may follow the grammar's forced text in the same draft, looked up over it (a JSON key, then the
    value the passage gives)."""

    capture: tuple[int, ...] = ()
    follows_forced = True
    drafts_trees = False

    def __init__(self, args, runner=None):
        self.min_n = args.speculative_ngram_min_match_window_size
        self.max_n = args.speculative_ngram_max_match_window_size
        self.indexes: dict = {}  # Req -> its NgramIndex

    def propose(self, step: DraftStep) -> Proposal:
        drafts = {}
        for req, size in step.sizes.items():
            index = self.indexes.get(req)
            if index is None:
                index = self.indexes[req] = NgramIndex(self.min_n, self.max_n)
            drafts[req] = Draft(index.propose(req.fill_ids, size, settled=req.seq_len))
        return Proposal(drafts)

    def flush(self) -> None:
        pass

    def release(self, req) -> None:
        self.indexes.pop(req, None)

    def copy_kv(self, src, dst, shift) -> None:
        pass

    def stats(self) -> dict:
        return {}


class NgramIndex:
    """Per request: for n in [min_ngram, max_ngram], the n-gram ending at each position -> the latest
    such end before the current one."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_n, self.max_n = min_ngram, max_ngram
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # positions < this have their n-grams in _ends

    def _catch_up(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions [_indexed, upto)."""
        for end in range(max(self._indexed, 1), upto):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, upto)

    def propose(self, tokens: list[int], k: int, settled: int | None = None) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the sequence's last tokens. Only the
        first `settled` tokens (default: all) are indexed; the rest (forced text not yet verified) may be
        rejected, so they only take part in this lookup."""
        length = len(tokens)
        settled = length if settled is None else settled
        if k <= 0 or length < 2:
            return []
        self._catch_up(tokens, settled)  # every settled n-gram ending before the last settled position
        draft: list[int] = []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[length - n :]))
            if end is not None and end < length:
                draft = tokens[end : min(end + k, length)]
                break
        if settled == length:  # the current suffix becomes an occurrence for later lookups
            for n in range(self.min_n, min(self.max_n, length) + 1):
                self._ends[tuple(tokens[length - n :])] = length
            self._indexed = length + 1
        return draft
