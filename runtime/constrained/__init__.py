"""Grammar-constrained decoding: backends (xgrammar, llguidance, outlines-core, and `auto` over them),
compile cache, bitmasks, jump-forward."""

from plait.runtime.constrained.base import BACKENDS, KINDS, GrammarBackend, GrammarCache, GrammarError, JsonStyle, \
    Matcher


def create_backend(name: str, tokenizer, vocab_size: int, eos_ids: list[int]) -> GrammarBackend | None:
    """The backend named by --grammar-backend, or None for 'none'."""
    if name == "none":
        return None
    if tokenizer is None:
        raise ValueError("a grammar backend needs the tokenizer (drop --skip-tokenizer-init or use --grammar-backend none)")
    if name == "auto":
        from plait.runtime.constrained.auto_backend import ORDER, AutoBackend

        return AutoBackend([create_backend(n, tokenizer, vocab_size, eos_ids) for n in ORDER])
    if name == "xgrammar":
        from plait.runtime.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_ids)
    if name == "llguidance":
        from plait.runtime.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, eos_ids)
    if name == "outlines":
        from plait.runtime.constrained.outlines_backend import OutlinesBackend

        return OutlinesBackend(tokenizer, vocab_size, eos_ids)
    raise ValueError(f"unknown grammar backend {name!r}")


__all__ = ["BACKENDS", "KINDS", "GrammarBackend", "GrammarCache", "GrammarError", "JsonStyle", "Matcher",
           "create_backend"]
