"""Mistral calls: `[TOOL_CALLS]` (a control token, dropped when special tokens are skipped) then a JSON list of
`{"name": ..., "arguments": {...}}`, or in newer tokenizers `[TOOL_CALLS]name[ARGS]{...}` per call."""

from __future__ import annotations

from plait.runtime.parsers.tool_call import Call, TaggedJsonParser, bare_calls, json_values, register

_TAG, _ARGS = "[TOOL_CALLS]", "[ARGS]"


@register("mistral")
class MistralParser(TaggedJsonParser):
    tag = _TAG
    how_to_call = ('To call tools, reply with [TOOL_CALLS] followed by a JSON list [{"name": <tool name>, '
                   '"arguments": <arguments object>}].')

    def body_calls(self, body: str, names: set[str], final: bool) -> tuple[str, list[Call]]:
        return ("", _named_calls(body, names)) if _ARGS in body else bare_calls(body, names, final)

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
