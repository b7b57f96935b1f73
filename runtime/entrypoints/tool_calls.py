"""Tool calls for /v1/chat/completions: the grammar that forces a valid call, the prompt that
tells a model about its tools, and the parser that reads calls back out of generated text.

Calls are JSON: `{"name": ..., "arguments": {...}}` (a list of them for tool_choice
"required": of one call unless `parallel_tool_calls` is true), constrained to the tools' parameter schemas
when the caller requires a call.
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


def _call_schema(tool: Tool, index: int, defs: dict) -> dict:
    """A call of `tool`; the definitions its parameters keep (`$defs`, `definitions`) move into `defs`, renamed
    for the tool, since its parameters no longer sit at the root their `#/$defs/...` references point to."""
    params = _hoisted(tool.function.parameters or {"type": "object", "properties": {}}, f"t{index}_", defs)
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _hoisted(params: dict, prefix: str, defs: dict) -> dict:
    own = {**params.get("definitions", {}), **params.get("$defs", {})}
    renamed = {name: f"{prefix}{name}" for name in own}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str):
                if ref == "#":  # the parameters themselves (a recursive model)
                    out["$ref"] = f"#/$defs/{prefix}root"
                    renamed.setdefault("#", f"{prefix}root")
                for kind in ("#/$defs/", "#/definitions/"):
                    name = ref[len(kind):].split("/")[0]
                    if ref.startswith(kind) and name in renamed:
                        out["$ref"] = f"#/$defs/{renamed[name]}" + ref[len(kind) + len(name):]
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    body = rewrite({k: v for k, v in params.items() if k not in ("$defs", "definitions")})
    for name, schema in own.items():
        defs[renamed[name]] = rewrite(schema)
    if "#" in renamed:
        defs[renamed["#"]] = body
    return body


def tool_call_schema(tools: list[Tool], mode: str, name: str | None, parallel: bool) -> str:
    """JSON schema of the output when a call is required ("required") or named ("named")."""
    defs: dict = {}
    if mode == "named":
        index = next(i for i, t in enumerate(tools) if t.function.name == name)
        schema = _call_schema(tools[index], index, defs)
    else:
        calls = [_call_schema(t, i, defs) for i, t in enumerate(tools)]
        item = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
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
    """Calls from output generated under tool_call_schema: valid JSON, or a prefix of it where max_tokens cut it
    short, of which the complete calls are returned (none of a cut single call)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = _complete_items(text)
    items = data if isinstance(data, list) else [data]
    return [make_call(c["name"], c["arguments"]) for c in items]


def _complete_items(text: str) -> list:
    """The complete items at the start of a JSON array cut short (`[{...}, {...}, {"na`)."""
    decoder, items = json.JSONDecoder(), []
    pos = text.find("[") + 1
    if pos == 0:
        return items
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items
        items.append(item)


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
