"""Tool calls under a grammar, for /v1/chat/completions and /v1/responses: the schema that forces a valid call
and the reading of what it generated.

A forced call is JSON, `{"name": ..., "arguments": {...}}` (a list of them for tool_choice "required": of one
call unless `parallel_tool_calls` is true), constrained to the tools' parameter schemas. With tools in auto mode
and a json_schema response format, the output is either one call or the final object. Free output ("auto" alone)
is read by the model family's parser (plait.runtime.parsers).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from plait.runtime.entrypoints.lark import TokenId, embedded_json, literal
from plait.runtime.entrypoints.openai_protocol import ChatCompletionRequest, Tool
from plait.runtime.parsers import ToolCallParser
from plait.runtime.parsers.tool_call import Call, call_of, json_values


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


def wire_call(call: Call) -> dict:
    """A call as the OpenAI API returns it (a fresh id)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def parse_constrained(text: str) -> list[Call]:
    """Calls from output generated under tool_call_schema: valid JSON, or a prefix of it where max_tokens cut it
    short (or a stream is still growing), of which the complete calls are returned (none of a cut single call)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        stripped = text.lstrip()
        data = json_values(stripped, 1)[0] if stripped.startswith("[") else []
    items = data if isinstance(data, list) else [data]
    return [Call(c["name"], c["arguments"]) for c in items
            if isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)]


def either_schema(tools: list[Tool], final: str) -> str:
    """With tools in auto mode and a json_schema response_format: one call of any tool, or the final object."""
    defs: dict = {}
    branches = [_call_schema(t, i, defs) for i, t in enumerate(tools)]
    branches.append(_hoisted(json.loads(final), "r_", defs))
    schema: dict = {"anyOf": branches}
    if defs:
        schema["$defs"] = defs
    return json.dumps(schema)


def either_grammar(tools: list[Tool], final: str, tags: tuple[str, str], token_id: TokenId, flexible: bool) -> str:
    """With tools in auto mode and a json_schema response format, for a model family whose calls a grammar can
    write (`tags` around the call's JSON): the rules of a `body` (lark.py) that is one call in that format or
    either_schema's JSON, so the model's first token chooses as it would unconstrained."""
    defs: dict = {}
    calls = [_call_schema(t, i, defs) for i, t in enumerate(tools)]
    call: dict = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        call = {**call, "$defs": defs}
    open_, close = tags
    # small models often write a call as bare JSON: the untagged branch takes that too (either_schema)
    return (f"body: call | final\n"
            f"call: {literal(open_, token_id)} {embedded_json(call, flexible)} {literal(close, token_id)}\n"
            f"final: {embedded_json(json.loads(either_schema(tools, final)), flexible)}\n")


def either_parse(text: str, tools: list[Tool]) -> list[Call]:
    """The call, if output made under either_schema is one (else it is the final object: content)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return []
    call = call_of(data, {t.function.name for t in tools})
    return [call] if call is not None and set(data) == {"name", "arguments"} else []


def tool_mode(req: ChatCompletionRequest, parser: ToolCallParser) -> str:
    """req.tool_mode(), or "either" for tools in auto mode beside a json_schema response format where the family's
    calls cannot be written by a grammar (the output is then the JSON of a call or of the final object)."""
    mode = req.tool_mode()
    if mode == "auto" and req.grammar().get("json_schema") is not None and parser.call_tags is None:
        return "either"
    return mode
