"""llguidance backend: JSON schema, regex, `ebnf` as GBNF (converted to Lark) or Lark itself, an
Earley parser over a lexer with token masks computed on demand (no precomputed mask cache, so
compiles take milliseconds). Its tokenizer is built from the model's own Hugging Face tokenizer.

llguidance's matcher never raises on a bad token: it enters an error state for good. So a token is
tried first (`try_consume_tokens`), which leaves the state unchanged when it is refused.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from plait.runtime.constrained.base import (MAX_WHITESPACE, Built, GrammarBackend, GrammarError, JsonStyle, Matcher,
                                            complete_utf8_prefix)
from plait.runtime.constrained.schema_policy import rewrite_schema

if TYPE_CHECKING:  # annotations only: the compile worker runs without torch (compile_worker.py)
    import torch


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher, eos_ids: frozenset[int], eos_taken: bool = False):
        self._m, self._eos = matcher, eos_ids
        # llguidance stops by itself where the grammar admits nothing more, and then refuses EOS; plait's
        # matchers take that EOS (as xgrammar's do), so it is only noted, for rollback
        self._eos_taken = eos_taken

    def accept_token(self, token: int) -> bool:
        if self._m.is_stopped():
            if token in self._eos and not self._eos_taken and self._m.is_accepting() and not self._m.is_error():
                self._eos_taken = True
                return True
            return False
        if self._m.try_consume_tokens([token]) == 1:
            return True
        if self._m.is_error():  # a limit of llguidance's that this token ran into (its mask allowed the token)
            raise GrammarError(f"llguidance: {_first_line(self._m.get_error())}")
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        if self._m.is_error():  # a limit of llguidance's (items, lexer fuel) that this grammar ran into
            raise GrammarError(f"llguidance: {_first_line(self._m.get_error())}")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._eos_taken:
            self._eos_taken, num_tokens = False, num_tokens - 1
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self._m.get_error()}")

    def is_terminated(self) -> bool:
        # stopped: EOS was taken, or the grammar admits nothing more (then only EOS could follow)
        return self._m.is_stopped() and not self._m.is_error()

    def jump_forward_string(self) -> str:
        forced = self._m.compute_ff_bytes()
        try:
            return forced.decode("utf-8")
        except UnicodeDecodeError as e:  # the forced bytes end inside a UTF-8 sequence
            return complete_utf8_prefix(forced, e.start)

    def copy(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self._m.deep_copy(), self._eos, self._eos_taken)


class _Compiled:
    """One matcher built at compile time; each request gets a deep copy (building one is the compile)."""

    backend = "llguidance"

    def __init__(self, matcher, eos_ids: frozenset[int], grammar: str, narrowed: tuple[str, ...] = ()):
        self._template, self._eos, self.grammar, self.narrowed = matcher, eos_ids, grammar, narrowed

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._eos)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    bounded_compile = True  # its lexer and parser run on fuel (ParserLimits): a compile cannot run away

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        import llguidance.hf  # binds llguidance too

        # n_vocab: the model's rows (may exceed the tokenizer's), so masks have the bitmask's width
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.padding is None and backend.truncation is None:
            # what from_tokenizer does, less its copy of the tokenizer (made to drop padding and truncation, which
            # this one has not): 1.7 s of start-up for a 262k vocabulary
            self._tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_ids))
        else:
            self._tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._eos = frozenset(eos_ids)

    def build(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> Built:
        """The grammar llguidance made of the request's (a JSON schema's rewrite and conversion done once, in the
        worker): load() builds the matcher from it."""
        compiled = self.compile(kind, text, style)
        return Built(self.name, compiled.grammar.encode(), compiled.narrowed)

    def load(self, built: Built, kind: str, text: str, style: JsonStyle) -> _Compiled:
        return self._matcher(kind, built.payload.decode(), built.narrowed, probe=False)

    def compile(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> _Compiled:
        import llguidance

        narrowed = ()
        if kind == "json_schema":  # keys in the schema's order always (llguidance has no other)
            schema, narrowed = rewrite_schema(text, self.name, style.narrow)
            if style.whitespace == "flexible":
                options = {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_WHITESPACE}}}"}
            else:  # xgrammar's compact separators, so the backends write alike
                options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:  # GBNF (SGLang's `ebnf`) converted to Lark; a grammar already in Lark passes as it is
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                lark = any_to_lark(text)
            except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad GBNF
                raise GrammarError(f"invalid ebnf: {_first_line(e)}") from None
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        return self._matcher(kind, grammar, narrowed, probe=True)

    def _matcher(self, kind: str, grammar: str, narrowed: tuple[str, ...], probe: bool) -> _Compiled:
        import llguidance

        matcher = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {kind}: {_first_line(matcher.get_error())}")
        if probe:  # the first mask, on a copy: a grammar past llguidance's limits fails here (a 400), not mid-request
            first = matcher.deep_copy()
            first.compute_bitmask()
            if first.is_error():
                raise GrammarError(f"{kind} exceeds llguidance's limits: {_first_line(first.get_error())}")
        return _Compiled(matcher, self._eos, grammar, narrowed)


def _first_line(e) -> str:
    """The error's first line, with the reason a regex error gives further down (`error: look-around ...
    is not supported`) and the pattern it is about."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    reason = next((line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")), None)
    if reason is None:
        return lines[0]
    return f"{lines[0].rstrip(':')}: {reason}" + (f" in {lines[1]!r}" if len(lines) > 2 else "")
