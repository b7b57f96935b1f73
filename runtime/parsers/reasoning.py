"""Reasoning blocks (`--reasoning-parser`): `<think>...</think>` before the answer, returned apart as
`reasoning_content`. "qwen3" reads a block the reply opens with; "deepseek-r1" (whose template opens the
block in the prompt) takes the reply as reasoning up to `</think>`. Either starts inside a block when the
rendered prompt ends with its opening tag."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    open: str = "<think>"
    close: str = "</think>"
    starts_inside: bool = False  # the reply begins inside a block whatever the prompt ends with

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        """(reasoning, content) of a whole reply; `inside`: the prompt opened the block."""
        body = self._body(text, inside)
        if body is None:
            return None, text
        reasoning, closed, content = body.partition(self.close)
        return reasoning.strip(), content.lstrip() if closed else ""

    def _body(self, text: str, inside: bool) -> str | None:
        if inside or self.starts_inside:
            return text[len(self.open):] if text.lstrip().startswith(self.open) else text
        stripped = text.lstrip()
        return stripped[len(self.open):] if stripped.startswith(self.open) else None


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek-r1": ReasoningParser("deepseek-r1", starts_inside=True),
}


def reasoning_parser(name: str, chat_template: str | None) -> ReasoningParser | None:
    """The parser named; "auto": qwen3's reading where the chat template knows `</think>`; "none": none."""
    if name == "none":
        return None
    if name == "auto":
        return REASONING_PARSERS["qwen3"] if chat_template and "</think>" in chat_template else None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """Splits a growing reply into reasoning deltas and the content after the block. Until the block's opening
    is ruled in or out (qwen3 style), nothing is sent; inside it, a tail that could begin the closing tag is
    held."""

    def __init__(self, parser: ReasoningParser, inside: bool):
        self.parser, self.inside = parser, inside or parser.starts_inside
        self.sent = 0  # characters of reasoning sent

    def feed(self, text: str, final: bool) -> tuple[str, str | None]:
        """(reasoning to send now, the content so far: None while the reply is still reasoning)."""
        p = self.parser
        stripped = text.lstrip()
        if not self.inside:
            if not final and p.open.startswith(stripped):
                return "", None  # could still be opening a block
            if not stripped.startswith(p.open):
                return "", text  # no block: all content
        body = p._body(text, self.inside)
        assert body is not None
        end = body.find(p.close)
        if end >= 0:
            return self._send(body, end), body[end + len(p.close):].lstrip()
        hold = 0 if final else next((k for k in range(min(len(p.close) - 1, len(body)), 0, -1)
                                     if body.endswith(p.close[:k])), 0)
        return self._send(body, len(body) - hold), "" if final else None

    def _send(self, body: str, end: int) -> str:
        start = self.sent
        if start == 0:  # the block's leading whitespace is not sent
            start = len(body) - len(body.lstrip())
        out = body[start:end] if end > start else ""
        self.sent = max(self.sent, end, start)
        return out
