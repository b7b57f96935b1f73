"""separate_reasoning: split a generated text into its reasoning and its answer, by model type."""

from __future__ import annotations

from typing import NamedTuple


class ThinkTags(NamedTuple):
    start: str
    end: str
    forced: bool  # the chat template opens the reasoning itself: text before `end` is reasoning


# model types of SGLang's --reasoning-parser that mark reasoning with a pair of tags
TAGS = {
    "deepseek-r1": ThinkTags("<think>", "</think>", True),
    "deepseek-v3": ThinkTags("<think>", "</think>", False),
    "qwen3": ThinkTags("<think>", "</think>", False),
    "qwen3-thinking": ThinkTags("<think>", "</think>", True),
    "glm45": ThinkTags("<think>", "</think>", False),
    "minimax": ThinkTags("<think>", "</think>", True),
    "step3": ThinkTags("<think>", "</think>", True),
    "kimi": ThinkTags("◁think▷", "◁/think▷", False),
}


def split_reasoning(text: str, model_type: str | None) -> tuple[str, str]:
    """(reasoning, answer). Without tags (or an unterminated reasoning) the text is all reasoning
    when the model type opens it by itself, else all answer."""
    tags = TAGS.get(model_type or "deepseek-r1")
    if tags is None:
        raise ValueError(f"separate_reasoning: unknown model_type {model_type!r}; known: {sorted(TAGS)}")
    body = text.lstrip()
    opened = body.startswith(tags.start)
    if opened:
        body = body[len(tags.start):]
    elif not tags.forced:
        return "", text
    end = body.find(tags.end)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(tags.end):].lstrip()
