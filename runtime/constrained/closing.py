"""Closing a grammar before the token budget runs out.

A small model at temperature 0 sometimes loops inside a length-bounded string ("Bakery-Bakery-Bak...")
until `max_new_tokens` cuts the output, which then does not parse. Near the end of the budget the
scheduler asks for a short completion of the grammar from the request's state (`plan_close`: a
depth-first search over the matcher that tries first what closes the most: `"`, `}`, `]`, then
separators, then the shortest values). When the tokens left only just hold that completion and the
end of sequence, the request's matcher becomes a `ClosingMatcher`: the model writes on as long as a
completion still fits after its token (searched again each time), and where none would, the plan's
next token is the only one allowed. The output is cut where the budget demands but complete, so it
parses and validates; the request reports it (finish_reason `length`, with the reason).
"""

from __future__ import annotations

import json
import string
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from plait.runtime.constrained.base import GrammarError, Matcher, token_texts
from plait.runtime.constrained.bitmask import allocate_bitmask, allow_only, allowed_bits
from plait.runtime.constrained.json_text import INSIDE, OPEN, OUTSIDE, StringScan

# the search begins this many tokens before the budget ends (a longer completion is not looked for): a
# document with several required values left (two date-times, an enum, a number) needs 50 tokens or more
CLOSE_WINDOW = 160
# the masks a search may compute (its unit of work: each node it expands, each candidate it probes). A count,
# not a clock, bounds it, so a request closes the same way on any machine at any load; searches over ordinary
# schemas take 250-320 masks at most (tests/test_grammar_backends.py)
MAX_MASKS = 1000
# a safety net, not a bound: a grammar whose masks are slow (a regex of 99,999 repeats: 60 ms a mask) would hold
# every request's next step for a minute, so a search past this fails its request loudly (GrammarError: a 400)
# rather than change its output
SEARCH_SAFETY_S = 5.0
_FALLBACK = 3
_KEPT_CHARS = 64
_REPEATS = 8  # texts of one kind this many times in a row in a string that cannot close: write another kind
_DISCREPANCIES = 2  # passes that leave the preferred path at most this many times, before a full search
_CLOSERS = set('"}]')
_PUNCTUATION = set("{}[],:")
_VALUES = ("0", '""', "[]", "{}", "null", "true", "false", '"', "[", "{", "-", "a", "t", "f", "n", " ")


@dataclass(frozen=True)
class CloseVocab:
    """What the search tries: the tokenizer (for forced text), the closing and value tokens in order,
    and which tokens are one character (the fallback)."""

    encode: Callable[[str], list[int]]
    texts: tuple[str, ...]
    ordered: torch.Tensor  # ids, in the order tried
    singles: torch.Tensor  # ids of the one-character tokens: letters and digits first
    eos_ids: torch.Tensor
    vocab_size: int
    rank: dict[int, int]  # place in `ordered`
    quotes: torch.Tensor  # the ordered ids that begin with '"' (close a string)
    punctuation: torch.Tensor  # the one-character ASCII punctuation tokens a string may hold (a pattern's separator)
    fillers: torch.Tensor  # "a", "0": what a pattern's last part most often wants after its separator

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, eos_ids: list[int]) -> "CloseVocab":
        texts = token_texts(tokenizer, min(len(tokenizer), vocab_size))
        # pure closers, longest first ('"}]' closes three in one token); then one separator with closers
        # (another item or a required key must follow); then the shortest values
        closers = sorted((i for i, s in enumerate(texts) if s and set(s) <= _CLOSERS), key=lambda i: -len(texts[i]))
        separated = sorted((i for i, s in enumerate(texts) if s.count(",") == 1 and set(s) <= _CLOSERS | {","}),
                           key=lambda i: -len(texts[i]))
        first_id = {s: i for i, s in reversed(list(enumerate(texts)))}
        values = [first_id[s] for s in _VALUES if s in first_id]
        singles = sorted((i for i, s in enumerate(texts) if len(s) == 1), key=lambda i: not texts[i].isalnum())
        ordered = list(dict.fromkeys(closers + separated + values))
        ids = partial(torch.tensor, dtype=torch.long)
        punctuation = [i for i in singles if texts[i].isascii() and texts[i] in string.punctuation
                       and texts[i] not in '"\\']
        return cls(lambda text: tokenizer.encode(text, add_special_tokens=False), tuple(texts), ids(ordered),
                   ids(singles), ids(sorted(eos_ids)), vocab_size, {t: i for i, t in enumerate(ordered)},
                   ids([t for t in ordered if texts[t].startswith('"')]), ids(punctuation),
                   ids([first_id[c] for c in "a0" if c in first_id]))


def _text_of(vocab: "CloseVocab", tok: int) -> str:
    return vocab.texts[tok] if tok < len(vocab.texts) else ""


def plan_close(matcher: Matcher, vocab: CloseVocab, text: "str | _Open", limit: int,
               required: frozenset[str] = frozenset()) -> list[int] | None:
    """Token ids that take `matcher` (having produced `text`, or what it left open) to a state where
    the end of sequence is allowed, at most `limit` of them; None if the search finds none. Depth
    first, trying first the tokens that leave the least JSON open (strings, arrays, objects) and, among
    equals, the closers, separators and short values in `vocab.ordered`, in passes of limited discrepancy
    (the preferred path, then those that leave it once, twice, then any); it backtracks out of dead ends
    and paths that run past `limit`, within MAX_MASKS masks (past SEARCH_SAFETY_S it raises GrammarError). Inside a
    string, text that begins a name the JSON schema requires (`required`: every prefix of those names, from
    required_prefixes) comes first, so an object's required keys are written before its optional ones. The
    matcher is left as it was."""
    bitmask, probe = allocate_bitmask(1, vocab.vocab_size), allocate_bitmask(1, vocab.vocab_size)
    masks = 0
    deadline = time.perf_counter() + SEARCH_SAFETY_S

    def fill(bits: torch.Tensor) -> None:
        nonlocal masks
        masks += 1
        if time.perf_counter() > deadline:
            raise GrammarError(f"closing the output took over {SEARCH_SAFETY_S:g} s ({masks} masks): this "
                               "grammar's masks are too slow to plan its end within max_new_tokens")
        matcher.fill_bitmask(bits, 0)

    def spent() -> bool:
        return masks >= MAX_MASKS

    def key(state: _Open, tok: int) -> tuple:
        text = _text_of(vocab, tok)
        after = state.after(text)
        # JSON punctuation written into a string closes nothing: letters are the better content
        content = text.split('"', 1)[0] if state.in_string else ""
        optional = bool(required and content) and state.chars + content not in required
        return (any(c in _PUNCTUATION for c in content), after.open, optional, len(text),
                vocab.rank.get(tok, len(vocab.rank)))

    def candidates(row: torch.Tensor, state: _Open) -> list[int]:
        forced = matcher.forced_tokens()
        if forced is None:
            forced_text = matcher.jump_forward_string()
            forced = vocab.encode(forced_text)[:1] if forced_text else []
        # a few allowed one-character tokens too, letters and digits and others (a pattern's digit, a
        # minLength's letter, a URI's colon)
        singles = vocab.singles[allowed_bits(row, vocab.singles)]
        tried = (vocab.ordered[allowed_bits(row, vocab.ordered)].tolist() + singles[:_FALLBACK].tolist()
                 + singles[-_FALLBACK:].tolist())
        tried.sort(key=lambda t: key(state, t))
        tried = list(dict.fromkeys(forced[:1] + tried))
        if state.in_string and not allowed_bits(row, vocab.quotes).any():
            # stuck inside a string (a pattern, a format, a minLength): first what lets it close next, then a
            # kind of text the string does not hold yet (the `:` of `^[a-z]+:[a-z]+`, after runs of letters)
            tried = list(dict.fromkeys(tried + vocab.punctuation[allowed_bits(row, vocab.punctuation)].tolist()))
            tried.sort(key=lambda t: (steps_to_close(t), _kind(_text_of(vocab, t)) in state.kinds))
        return tried

    def steps_to_close(tok: int) -> int:
        """0: a quote may follow `tok`; 1: it may after a letter or digit more; 2: neither (3: refused)."""
        if not matcher.accept_token(tok):
            return 3
        try:
            fill(probe)
            if allowed_bits(probe[0], vocab.quotes).any():
                return 0
            for filler in vocab.fillers[allowed_bits(probe[0], vocab.fillers)].tolist():
                if not matcher.accept_token(filler):
                    continue
                try:
                    fill(probe)
                    if allowed_bits(probe[0], vocab.quotes).any():
                        return 1
                finally:
                    matcher.rollback(1)
            return 2
        finally:
            matcher.rollback(1)

    def search(depth: int, state: _Open, slack: int) -> list[int] | None:
        """A completion from here that leaves the preferred token at most `slack` times (-1: any)."""
        fill(bitmask)  # the candidates come from it
        if allowed_bits(bitmask[0], vocab.eos_ids).any():  # the grammar may end here
            return []
        if depth == limit:  # too long: back out (another choice, a shorter tool name, may fit)
            return None
        tried = candidates(bitmask[0], state)
        if state.repeats >= _REPEATS and not allowed_bits(bitmask[0], vocab.quotes).any():
            # a string that cannot close yet, written the same way again and again ("0000" where a pattern wants
            # "0.0"): another kind of text next, or the search would try every run of that kind first
            # (a pattern that takes only that kind here, "[0-9]{10}", keeps it)
            tried = [t for t in tried if _kind(_text_of(vocab, t)) != state.last] or tried
        taken = 0
        for tok in tried:
            if spent() or (taken > slack >= 0):
                return None
            if not matcher.accept_token(tok):
                continue
            try:
                rest = search(depth + 1, state.after(_text_of(vocab, tok)), slack - (taken > 0) if slack > 0 else slack)
            finally:
                matcher.rollback(1)
            taken += 1
            if rest is not None:
                return [tok] + rest
        return None  # a dead end: the caller tries its next token

    if limit < 0:
        return None
    start = _Open().after(text) if isinstance(text, str) else text
    # limited discrepancy: the preferred path first, then paths that leave it once, twice (a depth-first
    # search spends its steps in the first choice's subtree: the longer tool name when a shorter one fits)
    for slack in (*range(_DISCREPANCIES + 1), -1):
        plan = search(0, start, slack)
        if plan is not None or spent():
            return plan
    return None


@dataclass(frozen=True)
class _Open:
    """What a JSON text leaves open: arrays and objects (`depth`), a string, an escape in it."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    repeats: int = 0  # how many texts of one kind in a row were written inside the string (_kind)
    last: str = ""  # the kind of the last
    chars: str = ""  # the string's text so far (its first _KEPT_CHARS: enough to tell a property name)
    kinds: frozenset[str] = frozenset()  # the kinds of text (_kind) written in the string

    @property
    def open(self) -> int:
        return self.depth + self.in_string

    def after(self, text: str) -> "_Open":
        depth, chars = self.depth, self.chars
        kind = _kind(text)
        repeats = self.repeats + 1 if self.in_string and kind == self.last else 1
        scan = StringScan(self.in_string, self.escaped)
        for ch in text:
            role = scan.step(ch)
            if role is INSIDE:
                if len(chars) < _KEPT_CHARS:
                    chars += ch
            elif role is OPEN:
                chars = ""
            elif role is OUTSIDE and ch in "[{":
                depth += 1
            elif role is OUTSIDE and ch in "]}":
                depth = max(0, depth - 1)
        in_string, escaped = scan.in_string, scan.escaped
        kinds = ((self.kinds if self.in_string else frozenset()) | {kind}) if in_string else frozenset()
        return _Open(depth, in_string, escaped, repeats if in_string else 0, kind if in_string else "",
                     chars if in_string else "", kinds)


def _kind(text: str) -> str:
    """Digits, letters, or the text itself: a run of one kind that a string's pattern will not close."""
    return "0" if text.isdigit() else "a" if text.isalpha() else text


class ClosingMatcher(Matcher):
    """A request's matcher once the tokens left only just hold a completion of its grammar. The model
    writes on while it can: a token is taken if the grammar takes it and a completion (searched again
    from there) still fits in the budget after it, the end of sequence included; any other is refused,
    and the mask then allows only the next token of the current plan (or the end, once the grammar
    may end). `cut` counts the refusals: the tokens the model would have written otherwise."""

    def __init__(self, inner: Matcher, plan: list[int], vocab: CloseVocab, text: str, budget: int,
                 required: frozenset[str] = frozenset()):
        self._inner, self._vocab, self._required = inner, vocab, required
        self._plan, self._open, self._budget = plan, _Open().after(text), budget  # budget: tokens still allowed
        self._history: list[tuple[list[int], _Open]] = []  # (plan, open) before each accepted token
        self.cut = 0
        self.searches, self.search_s = 0, 0.0  # plans searched after a model token, and their seconds

    def accept_token(self, token: int) -> bool:
        if not self._inner.accept_token(token):
            return False
        opened = self._open.after(_text_of(self._vocab, token))
        if self._plan and token == self._plan[0]:
            plan = self._plan[1:]
        elif self._inner.is_terminated():
            plan = []
        elif len(self._plan) <= self._budget - 2 and still_holds(self._inner, self._plan, self._vocab):
            plan = self._plan  # e.g. a letter inside a string the plan closes: no new search
        else:
            start = time.perf_counter()
            plan = plan_close(self._inner, self._vocab, opened, self._budget - 2, self._required)  # room for the end
            self.searches, self.search_s = self.searches + 1, self.search_s + time.perf_counter() - start
            if plan is None:
                self._inner.rollback(1)
                self.cut += 1
                return False
        self._history.append((self._plan, self._open))
        self._plan, self._open, self._budget = plan, opened, self._budget - 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if not self._plan:  # the grammar may end here: only the end (whatever else it allows may not fit)
            self._inner.fill_bitmask(bitmask, row)
            allow_only(bitmask, row, self._vocab.eos_ids[allowed_bits(bitmask[row], self._vocab.eos_ids)].tolist())
        else:
            allow_only(bitmask, row, self._plan[:1])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._history):
            raise RuntimeError(f"cannot roll back {num_tokens} tokens past where the closing began")
        if num_tokens:
            self._inner.rollback(num_tokens)
            self._plan, self._open = self._history[-num_tokens]
            del self._history[-num_tokens:]
            self._budget += num_tokens

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def jump_forward_string(self) -> str:
        return ""

    def forced_tokens(self) -> list[int]:
        """The plan, drafted: the model keeps what it agrees with and writes on where it does not."""
        return list(self._plan)

    def copy(self) -> "ClosingMatcher":
        twin = ClosingMatcher.__new__(ClosingMatcher)
        twin.__dict__.update(self.__dict__)
        twin._inner, twin._history = self._inner.copy(), list(self._history)
        return twin


def still_holds(matcher: Matcher, plan: list[int], vocab: CloseVocab) -> bool:
    """Whether `plan` still takes `matcher` to where the end is allowed (the matcher is left as it was)."""
    taken = 0
    try:
        for tok in plan:
            if not matcher.accept_token(tok):
                return False
            taken += 1
        return may_end(matcher, vocab, allocate_bitmask(1, vocab.vocab_size))
    finally:
        matcher.rollback(taken)


def may_end(matcher: Matcher, vocab: CloseVocab, bitmask: torch.Tensor) -> bool:
    """Whether the end of sequence is allowed next (row 0 of `bitmask` is left holding the mask)."""
    matcher.fill_bitmask(bitmask, 0)
    return bool(allowed_bits(bitmask[0], vocab.eos_ids).any())


def required_prefixes(schema_text: str | None) -> frozenset[str]:
    """Every prefix of every property name a JSON schema requires somewhere in it (plan_close writes those keys
    first; a set of prefixes makes its check of each candidate one lookup)."""
    if not schema_text:
        return frozenset()
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return frozenset()
    names, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            required = node.get("required")
            if isinstance(required, list):
                names.update(n for n in required if isinstance(n, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return frozenset(name[:k] for name in names for k in range(1, len(name) + 1))
