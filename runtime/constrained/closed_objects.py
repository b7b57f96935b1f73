"""Objects that list their properties admit only those, unless the schema says what else they admit.

JSON Schema leaves an object open by default (`additionalProperties` absent means any other key), so
a model may wander into keys nobody asked for (a tool call's `{"city": ..., "type": ..., ...}`) and
run out of tokens doing it. xgrammar's strict mode and OpenAI's strict schemas close such objects;
plait does the same for every backend, so the backends write alike. Closing admits a subset of the
documents the schema admits, so it is sound wherever the subschema is asserted as it stands; it is
not under `not` or an `if` condition (it would widen what they refuse), and not where another
schema adds properties to the same object (an `allOf` part, `then`/`else`, a dependent schema, a
branch whose parent lists properties of its own), where closing one part would refuse the other's.
"""

from __future__ import annotations

from typing import Any, Callable

# keywords that say what an object admits beyond its `properties`: such an object stays as it is
_OPEN_SAYERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# keywords whose schemas apply to the same instance alongside their parent's
_CONJUNCTS = ("allOf", "then", "else", "dependentSchemas", "dependencies")
# where closing would widen what is refused: negations, and oneOf (a branch closed may stop matching
# a document the others match, which then matches exactly one)
_NEGATED = ("not", "if", "oneOf")
_CHILDREN = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties")


def close_objects(root: Any, resolve: Callable[[str], Any]) -> None:
    """Sets `additionalProperties: false` in place on each closable object schema of `root`; `resolve` gives
    the subschema a `$ref` names (None where it names none)."""
    verdicts: dict[int, tuple[dict, bool]] = {}  # id -> (schema, closable at every use)
    _walk(root, True, resolve, verdicts, set())
    for schema, closable in verdicts.values():
        if closable:
            schema["additionalProperties"] = False


def _closable_here(schema: dict) -> bool:
    props = schema.get("properties")
    return (isinstance(props, dict) and bool(props) and not any(k in schema for k in _OPEN_SAYERS)
            and not any(k in schema for k in (*_CONJUNCTS, *_NEGATED, "anyOf", "$ref", "$dynamicRef")))


def _walk(schema: Any, closable: bool, resolve: Callable[[str], Any], verdicts: dict, seen: set) -> None:
    if not isinstance(schema, dict) or (id(schema), closable) in seen:
        return
    seen.add((id(schema), closable))
    if _closable_here(schema):
        prior = verdicts.get(id(schema), (schema, True))[1]
        verdicts[id(schema)] = (schema, prior and closable)
    adds_own = any(k in schema for k in ("properties", "required", *_OPEN_SAYERS))
    children = [schema.get(k) for k in _CHILDREN]
    for key in ("properties", "patternProperties"):  # definitions are judged where a $ref uses them
        if isinstance(schema.get(key), dict):
            children += schema[key].values()
    for key in ("prefixItems", "items"):  # items as a list: draft-4 tuples
        if isinstance(schema.get(key), list):
            children += schema[key]
    # an item counted against maxContains must not stop matching `contains`
    children.append(schema.get("contains") if "maxContains" not in schema else None)
    for child in children:
        _walk(child, closable, resolve, verdicts, seen)
    for key in _CONJUNCTS:
        parts = schema.get(key)
        for part in parts.values() if isinstance(parts, dict) else parts if isinstance(parts, list) else [parts]:
            _walk(part, False, resolve, verdicts, seen)
    for branch in schema.get("anyOf") or []:
        _walk(branch, closable and not adds_own, resolve, verdicts, seen)
    for key in _NEGATED:
        for part in schema.get(key) if isinstance(schema.get(key), list) else [schema.get(key)]:
            _walk(part, False, resolve, verdicts, seen)
    if "maxContains" in schema:
        _walk(schema.get("contains"), False, resolve, verdicts, seen)
    ref = schema.get("$ref")
    if isinstance(ref, str):  # a $ref beside other keywords is one more conjunct of its object
        _walk(resolve(ref), closable and not adds_own, resolve, verdicts, seen)
