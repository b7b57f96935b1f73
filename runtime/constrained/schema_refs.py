"""References rewritten, before the walk, into the one form every backend resolves: a `$ref` that is a plain JSON
pointer ('#/$defs/Name') whose names are letters, digits and `_.-$`.

Real schemas name definitions the way their generators do: Vega-Lite's `LogicalNot<Predicate>` and
`ConditionalValueDef<(number|ExprRef)>`, OpenAPI's `a/b` escaped as `a~1b`, and some senders percent-encode the
pointer as a URI fragment. Validators resolve all of these; measured, llguidance refuses `<`, `(` and spaces in a
reference ("Invalid URI reference") and xgrammar and outlines-core do not unescape `~1`. So each definition such
a reference names is renamed (its old name kept nowhere else: `definitions`/`$defs` are only names), and a
reference through any other oddly named member (a property called `a b`) points at a copy under `$defs`.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from plait.runtime.constrained.schema_keywords import ASSERTING

_VALUES = ("const", "enum", "examples", "default")  # keywords whose values are data, not subschemas
_PLAIN = re.compile(r"[A-Za-z0-9_.$-]+")
# keywords whose value maps names to subschemas (`definitions`/`$defs` hold names and nothing else)
_NAMED = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
_DEFINITIONS = {"$defs", "definitions"}
LEGACY_DRAFT = re.compile(r"draft-0[3-7]/schema")


def nodes(schema: Any, ptr: str = "#"):
    """(subschema-or-container dict, its pointer) for every dict in the schema, values of data keywords skipped."""
    stack = [(schema, ptr)]
    while stack:
        node, ptr = stack.pop()
        if isinstance(node, dict):
            yield node, ptr
            stack.extend((v, f"{ptr}/{escaped(k)}") for k, v in node.items() if k not in _VALUES)
        elif isinstance(node, list):
            stack.extend((v, f"{ptr}/{i}") for i, v in enumerate(node))


def escaped(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def refs_alone(schema: Any) -> None:
    """Drafts 3 to 7: what stands beside a `$ref` is ignored (as validators do), so it is dropped rather than
    enforced (`{"$ref": ..., "type": ...}` beside a recursive reference is more than some backends take)."""
    for node, _ in nodes(schema):
        if isinstance(node.get("$ref"), str):
            for key in [k for k in node if k in ASSERTING and k != "$ref"]:
                del node[key]


def anchors_as_pointers(schema: Any) -> None:
    """Rewrite, in place, each `$ref` to a plain-name anchor (`#foo`: a `$anchor`, or an `$id` of `#foo` in drafts
    6 and 7) as the JSON pointer to the subschema that declares it, which every backend resolves. In a schema of
    one resource (no `$id` below the root) a `$dynamicRef` can only land on its own resource's anchor: a `$ref`."""
    anchors, refs, resources = {}, [], 0
    for node, ptr in nodes(schema):
        for key in ("$anchor", "$dynamicAnchor", "$id"):
            name = node.get(key)
            if isinstance(name, str) and name.startswith("#") == (key == "$id") and name.strip("#"):
                anchors.setdefault(name.lstrip("#"), ptr)
        resources += isinstance(node.get("$id"), str) and not node["$id"].startswith("#") and ptr != "#"
        for key in ("$ref", "$dynamicRef"):
            ref = node.get(key)
            if isinstance(ref, str) and ref.startswith("#") and len(ref) > 1:
                refs.append((node, key))
    for node, key in refs:
        if key == "$dynamicRef":
            if resources or "$ref" in node:
                continue
            node["$ref"] = node.pop("$dynamicRef")
        if not node["$ref"].startswith("#/"):
            node["$ref"] = anchors.get(node["$ref"][1:], node["$ref"])


def drop_ids(schema: Any) -> None:
    """Every `$id` (draft 4's `id`) dropped from the rewritten schema: each reference in it is a pointer from the
    document's root by now, and a base URI would make a backend resolve one elsewhere (llguidance refuses a root
    `$id` with a fragment, as Lerna's schema has). A string is never a property's schema, so a property named
    `$id` stays."""
    for node, _ in nodes(schema):
        for key in ("$id", "id"):
            if isinstance(node.get(key), str):
                del node[key]


def recursive_refs(schema: Any) -> None:
    """`$recursiveRef` as validators read it: in draft 2019-09 a `$ref` where no `$recursiveAnchor` is set (left
    for the walk to refuse where one is); in any other draft not a keyword at all, so dropped (OpenAPI 3.1 specs
    carry 2019-09's `{"$recursiveRef": "#"}` in a 2020-12 document, where it admits anything)."""
    if not isinstance(schema, dict):
        return
    found = [node for node, _ in nodes(schema) if "$recursiveRef" in node or "$recursiveAnchor" in node]
    if not found:
        return
    if "2019-09" not in str(schema.get("$schema", "")):
        for node in found:
            node.pop("$recursiveRef", None)
            node.pop("$recursiveAnchor", None)
    elif not any(node.get("$recursiveAnchor") is True for node, _ in nodes(schema)):
        for node in found:
            if "$ref" not in node and "$recursiveRef" in node:
                node["$ref"] = node.pop("$recursiveRef")


def plain_refs(schema: Any) -> None:
    """Rewrite, in place, every local `$ref` pointer as a plain one (the module's docstring): percent-encoding and
    `~0`/`~1` decoded, definitions with other characters in their names renamed, a path through any other such
    name replaced by a copy of its target under `$defs`. A reference that does not resolve is left as sent (the
    walk refuses it by name)."""
    if not isinstance(schema, dict):
        return
    renamed: dict[tuple[int, str], str] = {}  # (id of a definitions map, old name) -> new name
    hoisted: dict[int, str] = {}  # id of a target -> its name under the root's $defs
    for node, _ in list(nodes(schema)):
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#") or ref == "#":
            continue
        path = _walk(schema, _segments(ref), renamed)
        if path is None:
            continue
        names, target = path
        if all(_PLAIN.fullmatch(n) for n in names):
            node["$ref"] = "#/" + "/".join(names)
            continue
        if id(target) not in hoisted:
            defs = schema.setdefault("$defs", {})
            hoisted[id(target)] = _fresh(_plain_name(names[-1]), defs)
            defs[hoisted[id(target)]] = target  # the same object: what refers into it resolves as before
        node["$ref"] = "#/$defs/" + hoisted[id(target)]


def _segments(ref: str) -> list[str]:
    """A pointer's reference tokens: its URI-fragment form decoded (RFC 6901 section 6), then `~1` and `~0`."""
    return [p.replace("~1", "/").replace("~0", "~") for p in unquote(ref[1:]).split("/")[1:]]


def _walk(root: dict, names: list[str], renamed: dict[tuple[int, str], str]) -> tuple[list[str], Any] | None:
    """The pointer's names as they now are (a definition named oddly renamed on the way) and its target; None
    where it does not resolve."""
    node, out, in_definitions, in_schema = root, [], False, True
    for name in names:
        if isinstance(node, list):
            if not name.isdigit() or int(name) >= len(node):
                return None
            node, in_definitions, in_schema = node[int(name)], False, True
            out.append(name)
            continue
        if not isinstance(node, dict):
            return None
        name = renamed.get((id(node), name), name)
        if name not in node:
            return None
        if in_definitions and not _PLAIN.fullmatch(name):
            new = _fresh(_plain_name(name), node)
            renamed[(id(node), name)] = new
            items = list(node.items())
            node.clear()  # rebuilt in its order, the one name changed
            node.update((new if k == name else k, v) for k, v in items)
            name = new
        out.append(name)
        # below a keyword whose value maps names to schemas, the next name is a member's; below that, a keyword
        in_definitions = in_schema and name in _DEFINITIONS
        in_schema = not (in_schema and name in _NAMED)
        node = node[name]
    return out, node


def _plain_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "def"


def _fresh(name: str, taken: dict) -> str:
    new, k = name, 1
    while new in taken:
        k += 1
        new = f"{name}_{k}"
    return new
