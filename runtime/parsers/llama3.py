"""Llama 3.x JSON calls: `<|python_tag|>` (a special token, dropped when special tokens are skipped) then
`{"name": ..., "parameters": {...}}`, several separated by `;`."""

from __future__ import annotations

import json

from plait.runtime.parsers.tool_call import Call, ToolCallParser, bare_calls, register

_TAG = "<|python_tag|>"


@register("llama3")
class Llama3Parser(ToolCallParser):
    starts = (_TAG,)
    bare_json = True
    template_markers = (_TAG,)

    def parse(self, text: str, names: set[str], final: bool) -> tuple[str, list[Call]]:
        head, tag, body = text.partition(_TAG)
        if not tag:
            head, body = "", text
        rest, calls = bare_calls(body, names, final)
        return (head + rest).strip() if calls else text, calls

    def instruction(self, tools: list[dict]) -> str:
        specs = "\n".join(json.dumps(t) for t in tools)
        return ("You can call these functions:\n" + specs + '\nTo call one, reply with only {"name": <function '
                'name>, "parameters": <arguments object>}.')

    def render(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls)
