"""Request bodies of the OpenAI API (pydantic, so a bad field is a 400 naming it).

Fields plait does not serve yet are rejected with a message rather than silently ignored.
SGLang/vLLM extras are accepted: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, regex, ebnf.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = None
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

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def sampling_params(self, max_new_tokens: int, index: int) -> dict[str, Any]:
        if self.regex is not None or self.ebnf is not None:
            raise ValueError("regex and ebnf constraints need a grammar backend, which this server does not have yet")
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
        return p


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

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


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

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
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _only_text(cls, v):
        if v and v.get("type") not in (None, "text"):
            raise ValueError(f"response_format {v.get('type')!r} needs a grammar backend, which this server "
                             "does not have yet")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tools need a grammar backend, which this server does not have yet")
        return v
