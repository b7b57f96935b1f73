"""Request bodies of Ollama's API (pydantic: a bad field is a 400 naming it), and how each maps onto the OpenAI
path plait already serves.

`options` holds Ollama's sampling options, mapped to plait's; its runtime knobs (threads, GPU layers, memory
mapping, batch size) say how Ollama's own engine should run and change nothing here, so they are accepted and
dropped; sampling methods plait does not implement (mirostat, typical-p, tail-free) are served at their neutral
values only; any other name is refused, named. Unset sampling options take Ollama's defaults (temperature 0.8,
top_k 40, top_p 0.9), so an app gets what it gets from Ollama."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Ollama's defaults for what a request leaves unset
_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# options that tune Ollama's engine, not the output: accepted, with nothing to do here
_RUNTIME_OPTIONS = frozenset({
    "num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "low_vram", "vocab_only", "use_mmap", "use_mlock",
    "num_thread", "numa", "f16_kv", "logits_all", "embedding_only", "rope_frequency_base", "rope_frequency_scale",
    "num_gqa", "repeat_last_n", "penalize_newline"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Options(_Strict):
    model_config = ConfigDict(extra="allow")  # checked by name below: runtime knobs dropped, others refused

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    num_predict: int | None = Field(None, ge=-2)  # -1: no limit, -2: fill the context
    stop: list[str] | None = None
    seed: int | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # sampling methods plait does not implement: their neutral values only
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None

    @model_validator(mode="after")
    def _known_names(self):
        for name, neutral in (("mirostat", 0), ("typical_p", 1), ("tfs_z", 1)):
            if getattr(self, name) not in (None, neutral):
                raise ValueError(f"option {name} is served at {neutral} only (plait does not implement it)")
        unknown = sorted(set(self.model_extra or {}) - _RUNTIME_OPTIONS)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}: plait takes Ollama's options (temperature, top_p, "
                             "top_k, min_p, num_predict, stop, seed, repeat_penalty, presence_penalty, "
                             "frequency_penalty) and accepts its runtime ones (num_ctx, num_thread, num_gpu, ...)")
        return self

    def sampling(self) -> dict[str, Any]:
        """The OpenAI-path fields these options set (Ollama's defaults where unset)."""
        out: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is None:
                value = _DEFAULTS.get(name)
            if value is not None:
                out[name] = value
        if out.get("top_k") == 0:  # Ollama's 0 turns top-k off
            out.pop("top_k")
        if self.repeat_penalty is not None:
            out["repetition_penalty"] = self.repeat_penalty
        if self.stop:
            out["stop"] = self.stop
        if self.num_predict is not None and self.num_predict > 0:
            out["max_tokens"] = self.num_predict
        return out


def _format(fmt: Any) -> dict | None:
    """`format` ("json" or a JSON schema) as an OpenAI response_format."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt}}
    raise ValueError('format must be "json" or a JSON schema (an object)')


class _Function(_Strict):
    model_config = ConfigDict(extra="ignore")  # some clients send an index or a description along
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(_Strict):
    model_config = ConfigDict(extra="ignore")  # an id or a type, depending on the client
    function: _Function


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""  # null beside tool calls, from some clients
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool result's tool
    thinking: str | None = None  # a returned reply's reasoning sent back as history: dropped

    @model_validator(mode="after")
    def _text_only(self):
        if self.images:
            raise ValueError("images are not supported (this server serves a text model)")
        return self


class _Request(_Strict):
    model: str
    format: Any = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None  # the model stays loaded while the server runs
    think: bool | Literal["low", "medium", "high"] | None = None

    def openai_fields(self) -> dict[str, Any]:
        out = (self.options or Options()).sampling()
        fmt = _format(self.format)
        if fmt is not None:
            out["response_format"] = fmt
        return out

    def num_predict(self) -> int | None:
        return self.options.num_predict if self.options is not None else None


class ChatRequest(_Request):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def openai_messages(self) -> list[dict[str, Any]]:
        """The conversation in the OpenAI shape: a call's arguments as JSON text, each tool result answering the
        earliest call not yet answered."""
        out, pending, n = [], [], 0
        for m in self.messages:
            if m.role == "assistant" and m.tool_calls:
                calls = []
                for c in m.tool_calls:
                    args = c.function.arguments
                    calls.append({"id": f"call_{n}", "type": "function", "function": {
                        "name": c.function.name, "arguments": args if isinstance(args, str) else json.dumps(args)}})
                    pending.append(f"call_{n}")
                    n += 1
                out.append({"role": "assistant", "content": m.content or None, "tool_calls": calls})
            elif m.role == "tool":
                msg = {"role": "tool", "content": m.content or ""}
                if pending:
                    msg["tool_call_id"] = pending.pop(0)
                out.append(msg)
            else:
                out.append({"role": m.role, "content": m.content or ""})
        return out


class GenerateRequest(_Request):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None  # a previous reply's context: the conversation so far, as token ids
    suffix: str | None = None
    template: str | None = None
    images: list[str] | None = None

    @model_validator(mode="after")
    def _served(self):
        if self.images:
            raise ValueError("images are not supported (this server serves a text model)")
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        if self.template:
            raise ValueError("template is not supported: the model's own chat template applies (or raw: true)")
        return self


class ShowRequest(_Strict):
    model: str | None = None
    name: str | None = None  # older clients' field
    verbose: bool = False

    def model_name(self) -> str:
        if not (self.model or self.name):
            raise ValueError("model is required")
        return self.model or self.name


class EmbedRequest(_Strict):
    """/api/embed: `input` a string or a list of strings (none: a load); inputs longer than the context are cut
    to it unless `truncate` is false."""

    model: str
    input: str | list[str] | None = None
    truncate: bool = True
    dimensions: int | None = None
    options: Options | None = None  # sampling options change nothing here
    keep_alive: str | int | float | None = None


class LegacyEmbeddingsRequest(_Strict):
    """/api/embeddings (Ollama's older route): one `prompt`."""

    model: str
    prompt: str = ""
    options: Options | None = None
    keep_alive: str | int | float | None = None
