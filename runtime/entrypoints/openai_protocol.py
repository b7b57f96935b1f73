"""Request bodies of the OpenAI API (pydantic, so a bad field is a 400 naming it).

An unknown field is a 400 naming it, as on /generate; fields plait does not serve are refused with a
message rather than silently ignored. Each model's `ignored` lists what OpenAI's clients send that
changes nothing plait does (bookkeeping such as `metadata`, hosted-only hints such as `service_tier`,
and the fields of a returned message or item sent back as history); those are accepted and dropped.
SGLang/vLLM extras are accepted: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, regex, ebnf.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from plait.runtime.entrypoints.http_guard import shown


class _Strict(BaseModel):
    """Unknown fields are refused, but for `ignored` ones, which are dropped."""

    model_config = ConfigDict(extra="forbid")
    ignored: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.ignored:
            return {k: v for k, v in data.items() if k not in cls.ignored}
        return data


# bookkeeping and hosted-only hints of a chat or completions request
_REQUEST_IGNORED = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                              "reasoning_effort", "verbosity", "modalities", "prediction"})


class StreamOptions(_Strict):
    ignored = frozenset({"include_obfuscation", "continuous_usage_stats"})
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # plait always enforces the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def schema_text(self) -> str | None:
        if self.type == "json_object":
            return '{"type": "object"}'  # any object (constrained/schema_policy.py)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema is required for type 'json_schema'")
            return json.dumps(self.json_schema.schema_)
        return None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    ignored = frozenset({"index"})  # a streamed call's delta index, when a client sends the deltas back
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class _Common(_Strict):
    ignored = _REQUEST_IGNORED

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, le=2**62)  # choice i uses seed + i
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # extras (SGLang / vLLM)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    ebnf: str | None = None
    response_format: ResponseFormat | None = None
    json_whitespace: Literal["compact", "flexible"] | None = None  # plait: the layout of a json_schema output
    json_key_order: Literal["schema", "any"] | None = None
    # SGLang's own extras, which its router sends with every request: served at their defaults only
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    return_hidden_states: bool = False

    @model_validator(mode="after")
    def _sglang_defaults_only(self):
        for name in ("separate_reasoning", "stream_reasoning", "return_hidden_states"):
            default = type(self).model_fields[name].default
            if getattr(self, name) != default:
                raise ValueError(f"{name}={json.dumps(not default)} is not supported by plait")
        return self

    @model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def _check_min_tokens(self, most: int | None, name: str) -> None:
        if most is not None and self.min_tokens > most:
            raise ValueError(f"min_tokens {self.min_tokens} is more than {name} {most}")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def grammar(self) -> dict[str, str]:
        """The one grammar constraint of the request, as sampling_params keys."""
        given = {k: v for k, v in (("regex", self.regex), ("ebnf", self.ebnf)) if v is not None}
        schema = self.response_format.schema_text() if self.response_format else None
        if schema is not None:
            given["json_schema"] = schema
        if len(given) > 1:
            raise ValueError(f"give at most one of regex, ebnf, response_format; got {sorted(given)}")
        if "json_schema" in given:
            given.update({k: v for k, v in (("json_whitespace", self.json_whitespace),
                                            ("json_key_order", self.json_key_order)) if v is not None})
        return given

    def sampling_params(self, max_new_tokens: int, index: int) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        p: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": min(self.min_tokens, max_new_tokens),
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "stop": stop,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
        }
        if self.top_k is not None:
            p["top_k"] = self.top_k
        if self.min_p is not None:
            p["min_p"] = self.min_p
        if self.repetition_penalty is not None:
            p["repetition_penalty"] = self.repetition_penalty
        if self.stop_token_ids:
            p["stop_token_ids"] = self.stop_token_ids
        if self.seed is not None:
            p["seed"] = self.seed + index  # n choices with one seed still differ, reproducibly
        p.update(self.grammar())
        return p


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _min_within_max(self):
        self._check_min_tokens(self.max_tokens, "max_tokens")
        return self

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("best_of is not supported (use n)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v


class ContentPart(_Strict):
    # parts of other types are refused by type, with a clearer message than their fields would get
    ignored = frozenset({"cache_control", "image_url", "input_audio", "file"})
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    # what a returned message carries when a client sends it back as history
    ignored = frozenset({"refusal", "annotations", "audio", "function_call", "reasoning_content", "reasoning"})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.role != "assistant" and (self.content is None or self.content == []):
            raise ValueError(f"a {self.role} message needs content (a string or a non-empty list of parts)")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"message content of type {part.type!r} is not supported (text only)")
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # None (not sent): one call, as the grammar then ends after it (a small model asked for a list of calls repeats
    # one until max_tokens); true: a list of one or more
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ: give one")
        self._check_min_tokens(self.max_completion_tokens or self.max_tokens, "the maximum tokens")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {shown(self.tool_choice.function.name)!r}, which is not in tools "
                                 f"{[shown(n) for n in names]}")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def tool_mode(self) -> str:
        """'none', 'auto', 'required' or 'named'."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


# ---- the Responses API (/v1/responses) ---------------------------------------------------------------------
class ResponseTool(_Strict):
    """A tool of the Responses API: flat (no `function` wrapper). Only function tools run here."""

    type: str
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _function_only(self):
        if self.type != "function":
            raise ValueError(f"tools of type {self.type!r} are not supported (function tools only)")
        if self.name is None:
            raise ValueError("a function tool needs a name")
        return self


class ResponseFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class ResponseTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseText(_Strict):
    ignored = frozenset({"verbosity"})
    format: ResponseTextFormat | None = None


class InputPart(_Strict):
    # an output_text part sent back; the fields of parts refused by type (a clearer message than theirs)
    ignored = frozenset({"annotations", "logprobs", "image_url", "file_id", "file_data", "file_url", "filename",
                         "detail"})
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type not in ("input_text", "output_text", "text", "refusal"):
            raise ValueError(f"input content of type {self.type!r} is not supported (text only)")
        return self


class InputItem(_Strict):
    """One item of `input`: a message (with or without `type`), a function call the model made earlier or the
    output of one. Reasoning items are taken and not shown to the model again."""

    ignored = frozenset({"id", "status", "summary", "encrypted_content"})  # an output item sent back
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self):
        need = {"message": ("role",), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output")}.get(self.type, ())
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"an input item of type {self.type!r} needs {', '.join(missing)}")
        return self


class ResponsesRequest(_Strict):
    ignored = frozenset({"include", "reasoning", "truncation", "service_tier", "prompt_cache_key",
                         "safety_identifier"})

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # extras, as in chat (SGLang / vLLM)
    seed: int | None = Field(None, ge=0, le=2**62)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    regex: str | None = None
    ebnf: str | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        if self.background and self.stream:
            raise ValueError("background responses cannot be streamed here: poll GET /v1/responses/{id}")
        if self.background and not self.store:
            raise ValueError("background responses must be stored (store: true)")
        return self


class EmbeddingRequest(_Strict):
    """/v1/embeddings. `input`: a string, a list of strings, a list of token ids or a list of such lists (checked
    by client/embeddings.EmbedInput); `dimensions` only where the model was trained for shorter embeddings."""

    ignored = frozenset({"user"})
    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
