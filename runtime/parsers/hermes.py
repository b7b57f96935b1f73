"""Hermes-style calls, which Qwen 2.5 and many fine-tunes write: `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` blocks, with content around them; also a reply that is itself a call's JSON (or a list of calls),
which small models often write instead. It is the generic format too: what plait tells a model about when its
chat template has no tools."""

from __future__ import annotations

import json
import re

from plait.runtime.parsers.tool_call import Call, ToolCallParser, bare_calls, calls_of, json_opening, register

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_OPEN = "<tool_call>"


@register("hermes", "qwen25", "generic")
class HermesParser(ToolCallParser):
    starts = (_OPEN,)
    bare_json = True
    template_markers = (_OPEN,)
    call_tags = (_OPEN + "\n", "\n</tool_call>")

    def parse(self, text: str, names: set[str], final: bool) -> tuple[str, list[Call]]:
        content, calls = tagged_calls(text, names, final)
        if calls or not json_opening(text):
            return content, calls
        return bare_calls(text, names, final)


def tagged_calls(text: str, names: set[str], final: bool) -> tuple[str, list[Call]]:
    """Calls of the complete `<tool_call>` blocks (and, once final, of an unclosed last block whose JSON is
    whole: the model stopped at the closing tag); the content is the text without the blocks."""
    calls, spans = [], []
    for m in _BLOCK.finditer(text):
        calls.extend(_block_calls(m.group(1), names))
        spans.append(m.span())
    tail = text.rfind(_OPEN)
    if final and tail >= 0 and not any(s <= tail < e for s, e in spans):
        found = _block_calls(text[tail + len(_OPEN):], names)
        if found:
            calls.extend(found)
            spans.append((tail, len(text)))
    if not calls:
        return text, []
    content, pos = [], 0
    for s, e in spans:
        content.append(text[pos:s])
        pos = e
    content.append(text[pos:])
    return "".join(content).strip(), calls


def _block_calls(body: str, names: set[str]) -> list[Call]:
    try:
        return calls_of(json.loads(body), names) or []
    except json.JSONDecodeError:
        return []
