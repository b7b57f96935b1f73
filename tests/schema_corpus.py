"""The schema corpus the structured-output tests share: real-world JSON schemas with labelled instances (a copy
of shared/schemas; sources in data/schemas/LICENSES.md), their validators, and small helpers."""

from __future__ import annotations

import json
import os

import jsonschema

CORPUS = os.path.join(os.path.dirname(__file__), "data", "schemas", "corpus.jsonl")


def corpus(every: int = 1) -> list[dict]:
    with open(CORPUS) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[::every]


def validator(row: dict):
    cls = getattr(jsonschema, row["draft"] + "Validator")
    cls = jsonschema.validators.extend(cls, {"multipleOf": _multiple_of(cls.VALIDATORS["multipleOf"])})
    return cls(row["schema"], format_checker=cls.FORMAT_CHECKER)


def _multiple_of(check):
    """multipleOf decided exactly, in fractions of the decimal texts, as JSON Schema defines it (the division
    gives an integer). jsonschema divides in floats: 2.51 / 0.01 is 250.99999999999997 there, so it refuses
    2.51 for multipleOf 0.01, and an integer of hundreds of digits (the model writes some) overflows."""
    from fractions import Fraction

    def multiple_of(validator, divisor, instance, schema):
        if not validator.is_type(instance, "number"):
            return
        if (Fraction(str(instance)) / Fraction(str(divisor))).denominator != 1:
            yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor}")
    return multiple_of


def schema_prompt(tokenizer, row: dict) -> str:
    text = json.dumps(row["schema"])
    if len(text) > 600:
        text = text[:600] + " ..."
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write one JSON document that follows this JSON schema:\n{text}"}],
        tokenize=False, add_generation_prompt=True)



def compact(data, separators: tuple[str, str] = (", ", ": ")) -> str:
    return json.dumps(data, ensure_ascii=False, separators=separators)  # the compact style's: ", " and ": "


def accepts(g, tokenizer, text: str) -> bool:
    m = g.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(m.accept_token(i) for i in ids) and m.accept_token(tokenizer.eos_token_id)


# grammars the tests share
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "city": {"enum": ["Paris", "London", "Tokyo", "New York"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"]}

SHOP = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "visits": {"type": "integer"},
    "opened": {"type": "string", "format": "date"}, "kind": {"enum": ["bakery", "florist"]},
    "products": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "minLength": 2}, "vegan": {"type": "boolean"}},
              "required": ["name", "vegan"], "additionalProperties": False}},
    "required": ["name", "visits", "opened", "kind", "products", "owner"], "additionalProperties": False}

REGEXES = {
    "date": r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z][a-z0-9._]{1,15}@[a-z]{2,10}\.(com|org|net)",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "enum": r"(red|green|blue|yellow)",
    "nested": r"((ab|cd)(ef)?){2,3}-(x(y|z){1,4})",
    "int": r"-?(0|[1-9]\d{0,6})",
}

ARITH = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num (("*" | "/") num)*
num ::= [1-9] [0-9]? | "(" expr ")"
'''

SQL = r'''
root ::= "SELECT " cols " FROM " ident where? ";"
cols ::= "*" | ident (", " ident)*
where ::= " WHERE " ident " " op " " value
op ::= "=" | "<" | ">"
value ::= [0-9]+ | "'" [a-z]+ "'"
ident ::= [a-z_]+
'''

SQL_RE = r"SELECT (\*|[a-z_]+(, [a-z_]+)*) FROM [a-z_]+( WHERE [a-z_]+ [=<>] ([0-9]+|'[a-z]+'))?;"
