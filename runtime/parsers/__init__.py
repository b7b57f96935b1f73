"""How model families write what is not plain content: tool calls (`--tool-call-parser`) and reasoning
(`--reasoning-parser`). Each format is a module that registers a parser; `tool_parser` and `reasoning_parser`
pick one by name or, for "auto", from what the chat template says.

The HTTP layer uses a parser two ways: on a whole output (a non-streamed response) and on a growing one,
through `ToolCallStream` / `ReasoningStream`, which send text as soon as it cannot be part of a call or of
the reasoning's end and hold back only what could."""

from plait.runtime.parsers.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream, reasoning_parser
from plait.runtime.parsers.tool_call import TOOL_PARSERS, Call, ToolCallParser, ToolCallStream, tool_parser

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "Call", "ReasoningParser", "ReasoningStream", "ToolCallParser",
           "ToolCallStream", "reasoning_parser", "tool_parser"]
