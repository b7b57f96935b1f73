"""The tool-call parser interface, its registry and the streaming split of content from calls.

A parser knows one family's format: the markers that open a call (`starts`), whether a reply that is
itself JSON is a call (`bare_json`), how to read calls out of text (`parse`), how to tell a model whose
chat template has no tools about them (`instruction`) and how to write a past call back into a prompt
(`render`). Calls are only kept for tools the request declared.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict


class ToolCallParser:
    name: ClassVar[str]
    starts: ClassVar[tuple[str, ...]] = ()  # text that opens a call anywhere in a reply
    bare_json: ClassVar[bool] = False  # a reply that opens with `{` or `[` (fenced or not) may be calls
    template_markers: ClassVar[tuple[str, ...]] = ()  # a chat template holding one of these writes this format
    call_tags: ClassVar[tuple[str, str] | None] = None  # the text around one call's JSON, where a grammar can write it
    how_to_call: ClassVar[str] = ('To call a tool, reply with <tool_call>{"name": <tool name>, "arguments": '
                                  '<arguments object>}</tool_call>.')

    def parse(self, text: str, names: set[str], final: bool) -> tuple[str, list[Call]]:
        """(the content left, the calls) of `text`; before the reply is `final`, only calls already complete."""
        raise NotImplementedError

    def instruction(self, tools: list[dict]) -> str:
        """A system note for templates that do not render tools: the tools and how to call one."""
        return "You can call these tools:\n" + "\n".join(json.dumps(t) for t in tools) + "\n" + self.how_to_call

    def render(self, calls: list[tuple[str, str]]) -> str:
        """Past calls (name, arguments JSON) as this format writes them, for templates without tool support."""
        return "\n".join(f'<tool_call>{{"name": "{n}", "arguments": {a}}}</tool_call>' for n, a in calls)


class TaggedJsonParser(ToolCallParser):
    """A format of a marker (`tag`) then the calls' JSON: text before the marker is content, and a reply without
    it is read as calls' JSON where it is only that (the marker may be a special token the detokenizer drops)."""

    tag: ClassVar[str]
    bare_json = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.starts = cls.template_markers = (cls.tag,)

    def parse(self, text: str, names: set[str], final: bool) -> tuple[str, list[Call]]:
        head, tag, body = text.partition(self.tag)
        if not tag:
            head, body = "", text
        rest, calls = self.body_calls(body, names, final)
        return (head + rest).strip() if calls else text, calls

    def body_calls(self, body: str, names: set[str], final: bool) -> tuple[str, list[Call]]:
        return bare_calls(body, names, final)


TOOL_PARSERS: dict[str, str] = {  # --tool-call-parser -> the module under plait.runtime.parsers that registers it
    "hermes": "hermes", "qwen25": "hermes", "generic": "hermes", "llama3": "llama3", "mistral": "mistral"}
_REGISTRY: dict[str, type[ToolCallParser]] = {}


def register(*names: str):
    def deco(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        for n in names:
            _REGISTRY[n] = cls
        return cls
    return deco


def tool_parser(name: str, chat_template: str | None) -> ToolCallParser:
    """The parser named, or for "auto" the first whose markers the chat template holds (else generic)."""
    if name == "auto":
        for candidate in ("hermes", "llama3", "mistral"):
            cls = _load(candidate)
            if chat_template and any(m in chat_template for m in cls.template_markers):
                return cls()
        name = "generic"
    return _load(name)()


def _load(name: str) -> type[ToolCallParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    importlib.import_module(f"plait.runtime.parsers.{TOOL_PARSERS[name]}")
    return _REGISTRY[name]


def call_of(data: Any, names: set[str]) -> Call | None:
    """A call from one decoded JSON value: {"name", "arguments" | "parameters"} naming a declared tool."""
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return Call(data["name"], args) if isinstance(args, dict) else None


def calls_of(data: Any, names: set[str]) -> list[Call] | None:
    """Calls from a decoded value that is one call or a list of them; None unless every item is a call."""
    items = data if isinstance(data, list) else [data]
    calls = [call_of(c, names) for c in items]
    return calls if calls and all(calls) else None  # type: ignore[return-value]


def json_values(text: str, pos: int = 0, separators: str = " \t\r\n,;") -> tuple[list, int]:
    """The JSON values written one after another from `pos` (with `separators` between), and where the first
    text that is not one starts."""
    decoder, values = json.JSONDecoder(), []
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos >= len(text):
            return values, pos
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, pos
        values.append(value)
        pos = end


# a reply may wrap its JSON in a Markdown code fence (small models often do)
_FENCE = re.compile(r"```[A-Za-z]*[ \t]*\n?")
_OPENING = re.compile(r"(```[A-Za-z]*\s*)?[\[{]")
_MAYBE_OPENING = re.compile(r"`{1,3}|```[A-Za-z]*\s*")


def json_opening(text: str) -> bool | None:
    """Whether a reply opens with JSON (in a code fence or not); None while its start could still be a fence."""
    stripped = text.lstrip()
    if _OPENING.match(stripped):
        return True
    return None if not stripped or _MAYBE_OPENING.fullmatch(stripped) else False


def bare_calls(text: str, names: set[str], final: bool) -> tuple[str, list[Call]]:
    """A reply of JSON calls one after another (objects or lists, `;` or `,` between), fenced or not: its
    complete calls, and once final all of them only when nothing but calls is written (else it is content)."""
    body = text.strip()
    fence = _FENCE.match(body)
    if fence:
        body = body[fence.end():]
        body = body[:-3] if body.rstrip().endswith("```") else body
        body = body.rstrip() if final else body
    values, end = json_values(body)
    text_left = body[end:]
    calls: list[Call] = []
    for v in values:
        found = calls_of(v, names)
        if found is None:
            return (text, []) if final else ("", calls)
        calls.extend(found)
    if final and text_left.strip():
        return text, []
    return "", calls


class ToolCallStream:
    """Splits a growing reply into content deltas and complete calls.

    Content is sent as it comes, less a tail that could be the start of a call marker; from the first
    marker on (or from the start, for a reply that opens with JSON where the format allows it) the text is
    held and handed to the parser, which returns each call as it completes. A held part that turns out to
    hold no call is sent as content at the end."""

    def __init__(self, parser: ToolCallParser, names: set[str]):
        self.parser, self.names = parser, names
        self.sent = 0  # characters of the reply sent as content
        self.calls = 0  # calls sent
        self.held_from: int | None = None  # where the call part begins

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        """(content to send now, new calls) for the reply so far."""
        if self.held_from is None:
            self.held_from = self._call_start(text, final)
            if self.held_from is None:
                end = len(text) if final else len(text) - self._partial_marker(text)
                return self._content(text, end), []
        if not text[self.sent:self.held_from].strip():
            self.sent = max(self.sent, self.held_from)  # only whitespace before the call: not worth a chunk
        out = self._content(text, self.held_from)
        rest, calls = self.parser.parse(text[self.held_from:], self.names, final)
        new = calls[self.calls:]
        self.calls = len(calls)
        if final:
            out += rest if calls else text[self.held_from:]
        return out, new

    def _content(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out

    def _call_start(self, text: str, final: bool) -> int | None:
        found = [i for i in (text.find(m) for m in self.parser.starts) if i >= 0]
        if self.parser.bare_json and self.sent == 0 and json_opening(text):
            found.append(len(text) - len(text.lstrip()))
        return min(found) if found else None

    def _partial_marker(self, text: str) -> int:
        """Characters at the end of `text` that could begin a marker (or, where a reply may be bare JSON and
        nothing is sent yet, the leading whitespace before its first character)."""
        if self.parser.bare_json and self.sent == 0 and json_opening(text) is None:
            return len(text)
        longest = 0
        for m in self.parser.starts:
            for k in range(min(len(m) - 1, len(text)), longest, -1):
                if text.endswith(m[:k]):
                    longest = k
                    break
        return longest
