"""Tool calls for /v1/chat/completions: the grammar that forces a valid call, the prompt that
tells a model about its tools, and the parser that reads calls back out of generated text.

Calls are JSON: `{"name": ..., "arguments": {...}}` (a list of them for tool_choice
"required"), constrained to the tools' parameter schemas when the caller requires a call.
With "auto" the model writes freely and calls are parsed from `<tool_call>...</tool_call>`
blocks (Hermes/Qwen style) or from output that is itself a call object or list.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from plait.runtime.entrypoints.openai_protocol import Tool

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _call_schema(tool: Tool) -> dict:
    params = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_schema(tools: list[Tool], mode: str, name: str | None, parallel: bool) -> str:
    """JSON schema of the output when a call is required ("required") or named ("named")."""
    if mode == "named":
        return json.dumps(_call_schema(next(t for t in tools if t.function.name == name)))
    calls = [_call_schema(t) for t in tools]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def tools_system_prompt(tools: list[Tool]) -> str:
    """For chat templates that do not render tools themselves."""
    specs = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                  "parameters": t.function.parameters or {}}) for t in tools)
    return ("You can call these tools:\n" + specs + "\nTo call a tool, reply with "
            '<tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>.')


def template_renders_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def make_call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_constrained(text: str) -> list[dict]:
    """Calls from output generated under tool_call_schema (always valid JSON unless cut short)."""
    data = json.loads(text)
    items = data if isinstance(data, list) else [data]
    return [make_call(c["name"], c["arguments"]) for c in items]


def parse_free(text: str, tools: list[Tool]) -> tuple[str | None, list[dict]]:
    """(remaining content, calls) from unconstrained output; calls only to known tools."""
    names = {t.function.name for t in tools}

    def calls_of(data: Any) -> list[dict] | None:
        items = data if isinstance(data, list) else [data]
        out = []
        for c in items:
            if not isinstance(c, dict) or c.get("name") not in names:
                return None
            args = c.get("arguments", c.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            out.append(make_call(c["name"], args))
        return out or None

    tagged = _TAGGED.findall(text)
    if tagged:
        calls = []
        for block in tagged:
            try:
                found = calls_of(json.loads(block))
            except json.JSONDecodeError:
                found = None
            if found:
                calls.extend(found)
        if calls:
            rest = _TAGGED.sub("", text).strip()
            return rest or None, calls
    stripped = text.strip()
    if stripped[:1] in "[{":
        try:
            found = calls_of(json.loads(stripped))
        except json.JSONDecodeError:
            found = None
        if found:
            return None, found
    return text, []
