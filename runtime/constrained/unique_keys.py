"""JSON objects without repeated keys, whatever the backend's grammar allows.

A grammar cannot say "each key once": an object open to any key (`additionalProperties`,
`patternProperties`) lets the model write `{"type": "a", "type": "b"}`. A JSON parser keeps the last,
so the document it reads has fewer properties than the grammar counted (`minProperties: 6` met by six
keys, one written twice) and values the schema never checked. `UniqueKeys` wraps a JSON schema's matcher
and follows the output's objects as plain text: a token that would close a key already written in the
same object is refused, and its bit cleared from the mask. Only tokens with a quote can close a key, so
a mask looks at those alone (163 of SmolLM2's 49,152), and only where an open object has a key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from plait.runtime.constrained.base import Matcher
from plait.runtime.constrained.bitmask import allowed_bits, clear_bits
from plait.runtime.constrained.json_text import CLOSE, INSIDE, OPEN, StringScan


@dataclass(frozen=True)
class KeyVocab:
    """Each token's text, the ids whose text holds at least 1, 2 or 3 quotes (inside a key a token
    closes it with one quote; outside strings it needs two; inside a value string three), and those holding a
    comma (which may lead to the next key), and of those the ones also holding a quote (only they leave a string)."""

    texts: tuple[str, ...]
    quoted: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    commas: torch.Tensor
    quoted_commas: torch.Tensor

    @classmethod
    def from_texts(cls, texts: tuple[str, ...]) -> "KeyVocab":
        counts = [s.count('"') for s in texts]
        ids: Callable[[int], torch.Tensor] = lambda n: torch.tensor(  # noqa: E731
            [i for i, c in enumerate(counts) if c >= n], dtype=torch.long)
        commas = [i for i, s in enumerate(texts) if "," in s]
        return cls(texts, (ids(1), ids(2), ids(3)), torch.tensor(commas, dtype=torch.long),
                   torch.tensor([i for i in commas if counts[i]], dtype=torch.long))


@dataclass(frozen=True)
class _Objects:
    """What a JSON text leaves open: per container, the keys its object holds (None for an array); an open
    string, and whether it is a key (its text so far kept) and after a backslash; whether a key comes next."""

    frames: tuple[frozenset[str] | None, ...] = ()
    in_string: bool = False
    in_key: bool = False
    escaped: bool = False
    key_next: bool = False
    key: str = ""

    @property
    def watched(self) -> bool:
        """Whether some open object has a key, so a token could repeat one."""
        return any(self.frames)

    def after(self, text: str) -> "_Objects | None":
        """The state after `text`; None where it closes a key its object already holds."""
        frames, in_key, key_next, key = self.frames, self.in_key, self.key_next, self.key
        scan = StringScan(self.in_string, self.escaped)
        for ch in text:
            role = scan.step(ch)
            if role is INSIDE:
                if in_key:
                    key += ch
            elif role is CLOSE:
                if in_key:
                    name = _decoded(key)
                    if name in frames[-1]:
                        return None
                    frames = frames[:-1] + (frames[-1] | {name},)
            elif role is OPEN:
                in_key, key, key_next = key_next, "", False
            elif ch == "{":
                frames, key_next = frames + (frozenset(),), True
            elif ch == "[":
                frames, key_next = frames + (None,), False
            elif ch in "]}":
                frames, key_next = frames[:-1], False
            elif ch == ",":
                key_next = bool(frames) and frames[-1] is not None
            elif ch == ":":
                key_next = False
        return _Objects(frames, scan.in_string, in_key, scan.escaped, key_next, key)


def _decoded(raw: str) -> str:
    """A key's text as a parser reads it (`\\u0061` and `a` are one key)."""
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


class UniqueKeys(Matcher):
    """A JSON matcher that refuses a key its object already holds (see the module's docstring)."""

    def __init__(self, inner: Matcher, vocab: KeyVocab):
        self._inner, self._vocab = inner, vocab
        self._state = _Objects()
        self._history: list[_Objects] = []  # the state before each accepted token

    def _text(self, token: int) -> str:
        return self._vocab.texts[token] if token < len(self._vocab.texts) else ""

    def accept_token(self, token: int) -> bool:
        after = self._state.after(self._text(token))
        if after is None or not self._inner.accept_token(token):
            return False
        if self._forces_repeat(after):
            self._inner.rollback(1)
            return False
        self._history.append(self._state)
        self._state = after
        return True

    def _forces_repeat(self, after: "_Objects") -> bool:
        """Whether, with the inner matcher just past a token that left `after`, the text the grammar forces next
        names a key its object holds (a grammar may force a property's name twice): a dead end ahead, so the
        token is refused."""
        if not (after.watched and (after.key_next or after.in_key)):
            return False
        forced = self._inner.jump_forward_string()
        return bool(forced) and after.after(forced) is None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner.fill_bitmask(bitmask, row)
        state = self._state
        if not state.watched:
            return
        quotes = 1 if state.in_key else 3 if state.in_string else 2
        ids = self._vocab.quoted[quotes - 1]
        ids = ids[allowed_bits(bitmask[row], ids)]
        repeats = [t for t in ids.tolist() if state.after(self._vocab.texts[t]) is None]
        # a comma that reaches the next key: in a string, only a token with a quote leaves it
        commas = self._vocab.quoted_commas if state.in_string else self._vocab.commas
        for t in commas[allowed_bits(bitmask[row], commas)].tolist():  # few are allowed at once
            after = state.after(self._vocab.texts[t])
            if after is not None and after.key_next and self._inner.accept_token(t):
                if self._forces_repeat(after):
                    repeats.append(t)
                self._inner.rollback(1)
        if repeats:
            clear_bits(bitmask, row, repeats)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._inner.rollback(num_tokens)
            self._state = self._history[-num_tokens]
            del self._history[-num_tokens:]

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def jump_forward_string(self) -> str:
        return self._inner.jump_forward_string()

    def forced_tokens(self) -> list[int] | None:
        return self._inner.forced_tokens()

    def copy(self) -> "UniqueKeys":
        twin = UniqueKeys(self._inner.copy(), self._vocab)
        twin._state, twin._history = self._state, list(self._history)
        return twin
