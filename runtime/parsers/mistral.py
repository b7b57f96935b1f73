"""Mistral calls: `[TOOL_CALLS]` (a control token, dropped when special tokens are skipped) then a JSON list of
`{"name": ..., "arguments": {...}}`, or in newer tokenizers `[TOOL_CALLS]name[ARGS]{...}` per call."""

from __future__ import annotations

import json

from plait.runtime.parsers.tool_call import Call, ToolCallParser, bare_calls, json_values, register

_TAG, _ARGS = "[TOOL_CALLS]", "[ARGS]"


@register("mistral")
class MistralParser(ToolCallParser):
    starts = (_TAG,)
    bare_json = True
    template_markers = (_TAG,)

    def parse(self, text: str, names: set[str], final: bool) -> tuple[str, list[Call]]:
        head, tag, body = text.partition(_TAG)
        if not tag:
            head, body = "", text
        if _ARGS in body:
            calls = _named_calls(body, names)
            rest = ""
        else:
            rest, calls = bare_calls(body, names, final)
        return (head + rest).strip() if calls else text, calls

    def instruction(self, tools: list[dict]) -> str:
        specs = "\n".join(json.dumps(t) for t in tools)
        return ("You can call these tools:\n" + specs + '\nTo call tools, reply with [TOOL_CALLS] followed by a '
                'JSON list [{"name": <tool name>, "arguments": <arguments object>}].')

    def render(self, calls: list[tuple[str, str]]) -> str:
        return _TAG + "[" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"


def _named_calls(body: str, names: set[str]) -> list[Call]:
    calls = []
    for part in body.split(_TAG):
        name, sep, args = part.partition(_ARGS)
        values, _ = json_values(args)
        if sep and name.strip() in names and values and isinstance(values[0], dict):
            calls.append(Call(name.strip(), values[0]))
    return calls
