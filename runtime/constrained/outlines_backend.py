"""outlines-core backend: JSON schema (through its schema-to-regex builder) and regex, compiled
to a token-level DFA index over the vocabulary. No EBNF. Jump-forward follows the chain of
states that allow exactly one token."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from plait.runtime.constrained.base import MAX_WHITESPACE, Built, GrammarBackend, GrammarError, JsonStyle, Matcher
from plait.runtime.constrained.schema_policy import rewrite_schema

if TYPE_CHECKING:  # annotations only: the compile worker runs without torch (compile_worker.py)
    import torch

_MAX_ROLLBACK = 128  # a closing search (closing.py) plus a jump-forward walk inside it
_MAX_JUMP_TOKENS = 32


class OutlinesMatcher(Matcher):
    def __init__(self, index, eos_id: int, decode):
        from outlines_core import Guide

        self._index, self._eos, self._decode = index, eos_id, decode
        self._guide = Guide(index, max_rollback=_MAX_ROLLBACK)
        self._accepted: list[int] = []
        self._terminated = False

    def accept_token(self, token: int) -> bool:
        if self._terminated:
            return False
        if token == self._eos:  # accepts_tokens refuses EOS even in a final state: ask the state's tokens
            if self._eos not in self._guide.get_tokens():
                return False
            self._terminated = True
        elif self._guide.accepts_tokens([token]):
            self._guide.advance(token, return_tokens=False)
        else:
            return False
        self._accepted.append(token)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        target.zero_()
        if self._terminated:
            return
        self._guide.write_mask_into(target.data_ptr(), target.numel(), 4)

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        tail = self._accepted[-num_tokens:]
        del self._accepted[-num_tokens:]
        if tail and tail[-1] == self._eos and self._terminated:
            self._terminated = False
            tail = tail[:-1]
        if tail:
            self._guide.rollback_state(len(tail))

    def is_terminated(self) -> bool:
        return self._terminated

    def jump_forward_string(self) -> str:
        forced = self.forced_tokens()
        return self._decode(forced) if forced else ""

    def forced_tokens(self) -> list[int]:
        """The chain of states that allow exactly one token (the index knows tokens, not text)."""
        forced: list[int] = []
        while len(forced) < _MAX_JUMP_TOKENS:
            allowed = self._guide.get_tokens()
            if len(allowed) != 1 or allowed[0] == self._eos:
                break
            forced.append(allowed[0])
            self._guide.advance(allowed[0], return_tokens=False)
        if forced:
            self._guide.rollback_state(len(forced))
        return forced

    def copy(self) -> "OutlinesMatcher":
        other = OutlinesMatcher(self._index, self._eos, self._decode)
        for t in self._accepted:
            other.accept_token(t)
        return other


class _Compiled:
    backend = "outlines"

    def __init__(self, index, eos_id: int, decode, narrowed: tuple[str, ...] = ()):
        self.index, self.eos_id, self.decode, self.narrowed = index, eos_id, decode, narrowed

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self.index, self.eos_id, self.decode)


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        from outlines_core import Vocabulary

        self._eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(eos_ids)
        self._vocab = Vocabulary(self._eos, token_bytes(tokenizer, vocab_size))
        self._decode = lambda ids: tokenizer.decode(ids)

    def compile(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> _Compiled:
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "ebnf":
            raise GrammarError("the outlines backend has no EBNF support (use --grammar-backend xgrammar)")
        narrowed = ()
        try:
            if kind == "json_schema":
                schema, narrowed = rewrite_schema(text, self.name, style.narrow)
                # compact: no whitespace at all (outlines-core puts the gap pattern around every separator)
                gap = f"[ \\t\\n\\r]{{0,{MAX_WHITESPACE}}}" if style.whitespace == "flexible" else ""
                regex = build_regex_from_schema(json.dumps(schema), gap)
            else:
                regex = text
            index = Index(regex, self._vocab)
        except GrammarError:
            raise
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(f"invalid {kind}: {str(e).strip().splitlines()[0]}") from None
        return _Compiled(index, self._eos, self._decode, narrowed)

    def build(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> Built:
        compiled = self.compile(kind, text, style)
        _, (data,) = compiled.index.__reduce__()  # (Index.from_binary, (bytes,))
        return Built(self.name, data, compiled.narrowed)

    def load(self, built: Built, kind: str, text: str, style: JsonStyle) -> _Compiled:
        from outlines_core import Index

        return _Compiled(Index.from_binary(built.payload), self._eos, self._decode, built.narrowed)


def token_bytes(tokenizer, vocab_size: int) -> dict[bytes, list[int]]:
    """Every ordinary token's raw bytes (byte-level BPE or SentencePiece), as outlines-core wants."""
    special = set(tokenizer.all_special_ids)
    byte_of = {ch: b for b, ch in _gpt2_byte_chars().items()}
    out: dict[bytes, list[int]] = {}
    for tok, i in tokenizer.get_vocab().items():
        if i in special or i >= vocab_size:
            continue
        if all(c in byte_of for c in tok):
            raw = bytes(byte_of[c] for c in tok)
        elif tok.startswith("<0x") and tok.endswith(">") and len(tok) == 6:
            raw = bytes([int(tok[3:5], 16)])
        else:
            raw = tok.replace("\u2581", " ").encode()
        out.setdefault(raw, []).append(i)
    return out


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
