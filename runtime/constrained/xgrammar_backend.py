"""xgrammar backend: JSON schema, regex and EBNF, compiled to a pushdown automaton with a
token mask cache; jump-forward strings come from the matcher itself."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from plait.runtime.constrained.base import (MAX_WHITESPACE, Built, GrammarBackend, GrammarError, JsonStyle, Matcher,
                                            complete_utf8_prefix)
from plait.runtime.constrained.schema_policy import rewrite_schema

if TYPE_CHECKING:  # annotations only: the compile worker runs without torch (compile_worker.py)
    import torch


class XGrammarMatcher(Matcher):
    def __init__(self, compiled, accepted: list[int] | None = None):
        import xgrammar as xgr

        self._compiled = compiled
        self._m = xgr.GrammarMatcher(compiled)  # rollback depth is unlimited
        self._accepted: list[int] = []  # for copy(); only the tail a rollback can reach matters
        for t in accepted or []:
            self.accept_token(t)

    def accept_token(self, token: int) -> bool:
        ok = self._m.accept_token(token)
        if ok:
            self._accepted.append(token)
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)
            del self._accepted[-num_tokens:]

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def jump_forward_string(self) -> str:
        try:
            return self._m.find_jump_forward_string()
        except UnicodeDecodeError as e:
            # the forced bytes end (or break) inside a UTF-8 sequence: keep the complete characters
            # before it; the rest is sampled token by token
            return complete_utf8_prefix(e.object, e.start)

    def copy(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self._compiled, self._accepted)


class _Compiled:
    backend = "xgrammar"

    def __init__(self, compiled, narrowed: tuple[str, ...] = ()):
        self.compiled, self.narrowed = compiled, narrowed

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        # the compile side's modules by name: they are all a compile worker imports (import_compile_side)
        from xgrammar.compiler import GrammarCompiler
        from xgrammar.tokenizer_info import TokenizerInfo

        self._info = TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids))
        # plait keeps its own LRU (GrammarCache), so xgrammar's cache would only double the memory
        self._compiler = GrammarCompiler(self._info, max_threads=1, cache_enabled=False)

    def build(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> Built:
        compiled = self.compile(kind, text, style)
        return Built(self.name, compiled.compiled.serialize_json().encode(), compiled.narrowed)

    def load(self, built: Built, kind: str, text: str, style: JsonStyle) -> _Compiled:
        from xgrammar.compiler import CompiledGrammar

        return _Compiled(CompiledGrammar.deserialize_json(built.payload.decode(), self._info), built.narrowed)

    def compile(self, kind: str, text: str, style: JsonStyle = JsonStyle()) -> _Compiled:
        narrowed = ()
        try:
            if kind == "json_schema":
                schema, narrowed = rewrite_schema(text, self.name, style.narrow)
                flexible = style.whitespace == "flexible"
                g = self._compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=flexible, max_whitespace_cnt=MAX_WHITESPACE if flexible else None,
                    strict_mode=True, any_order=style.key_order == "any")
            elif kind == "regex":
                g = self._compiler.compile_regex(text)
            else:
                g = self._compiler.compile_grammar(text)
        except GrammarError:
            raise
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"invalid {kind}: {_clean(e)}") from None
        return _Compiled(g, narrowed)


def _clean(e: Exception) -> str:
    """xgrammar prefixes its messages with a timestamp and a C++ source location."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if msg.startswith("[") and ": " in msg:
        msg = msg.split(": ", 1)[1]
        if ".cc:" in msg.split(" ", 1)[0]:
            msg = msg.split(": ", 1)[-1]
    return msg


def import_compile_side() -> None:
    """Import xgrammar's compiler and tokenizer info without its package `__init__`, which imports its matchers and
    with them torch (150 MB and a second of CPU in a compile worker, which never fills a mask). Idempotent; where
    xgrammar is already imported whole, nothing changes."""
    import importlib.util
    import sys
    import types

    if "xgrammar" in sys.modules:
        return
    spec = importlib.util.find_spec("xgrammar")
    if spec is None:
        return  # not installed: create_backend says so where it is asked for
    package = types.ModuleType("xgrammar")
    package.__spec__, package.__path__ = spec, list(spec.submodule_search_locations or [])
    sys.modules["xgrammar"] = package
    import xgrammar.exception  # noqa: F401 - as the package's __init__ begins: its errors, then the C++ library
    import xgrammar.load_binding  # noqa: F401
    import xgrammar.compiler  # noqa: F401
    import xgrammar.tokenizer_info  # noqa: F401
