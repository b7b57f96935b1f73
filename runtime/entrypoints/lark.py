"""Grammars the OpenAI layer composes in llguidance's Lark (JSON schemas embedded with `%json`): text the model
family writes around a constrained part, its tags as the one token each is where it is one.

Each embedded schema passes the same policy as a response_format (constrained/schema_policy.py: a 400 for what
no backend enforces exactly); the whitespace options are the ones the JSON backends use.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from plait.runtime.constrained.base import MAX_WHITESPACE

TokenId = Callable[[str], "int | None"]  # the id of text that is one token, else None


def embedded_json(schema: dict, flexible: bool) -> str:
    from plait.runtime.constrained.schema_policy import prepare_schema

    options = {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_WHITESPACE}}}"} if flexible else \
        {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    prepared = prepare_schema(schema, "llguidance")
    prepared = {**prepared, "x-guidance": options} if isinstance(prepared, dict) else prepared
    return "%json " + json.dumps(prepared)


def literal(text: str, token_id: TokenId) -> str:
    """`text` as a Lark expression: its tag (the text less surrounding whitespace) as its one token where it is
    one (a special token matches no text), else as text."""
    head = text.strip()
    tid = token_id(head)
    start = text.index(head)
    parts = [json.dumps(text[:start]), f"<[{tid}]>" if tid is not None else json.dumps(head),
             json.dumps(text[start + len(head):])]
    return " ".join(p for p in parts if p != '""')


def after_reasoning(body: str, open_tag: str, close_tag: str, inside: bool, token_id: TokenId) -> str:
    """A grammar whose `body` rule (defined in `body`'s rules) applies only after a reasoning block: free text up
    to the first closing tag (a lazy lexeme: llguidance's lexemes are otherwise greedy), the block opened by
    the prompt when `inside`, else by the reply or left out. Where the closing tag is one token, also that
    token after any text (a special token matches no text)."""
    def regex(tag: str) -> str:
        return re.escape(tag).replace("/", "\\/")

    opening = "" if inside else regex(open_tag)
    rules = [f"think_text[lazy]: /{opening}(.|\\n)*{regex(close_tag)}/"]
    alternatives = ["think_text"]
    close_id = token_id(close_tag)
    if close_id is not None:
        opening = "" if inside else literal(open_tag, token_id) + " "
        rules.append("FREE: /(.|\\n)*/")
        alternatives.append(f"{opening}FREE <[{close_id}]>")
    start = "start: think GAP body" if inside else "start: (think GAP)? body"
    return "\n".join([start, "think: " + " | ".join(alternatives), *rules, "GAP: /[ \\t\\r\\n]{0,4}/", body])


def json_body(schema: str, flexible: bool) -> str:
    """The rules of a json_schema constraint as the `body` rule."""
    return f"body: {embedded_json(json.loads(schema), flexible)}\n"
