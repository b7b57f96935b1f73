"""Llama 3.x JSON calls: `<|python_tag|>` (a special token, dropped when special tokens are skipped) then
`{"name": ..., "parameters": {...}}`, several separated by `;`."""

from __future__ import annotations

from plait.runtime.parsers.tool_call import TaggedJsonParser, register


@register("llama3")
class Llama3Parser(TaggedJsonParser):
    tag = "<|python_tag|>"
    how_to_call = 'To call one, reply with only {"name": <function name>, "parameters": <arguments object>}.'

    def render(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls)
