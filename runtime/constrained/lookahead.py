"""A pattern that opens with a negative lookahead of literal prefixes (`^(?!lucene\\.|builtin\\.).*`, a
common way to reserve names), as two patterns without lookaround whose intersection means the same: the
rest of the pattern, and "does not start with any of the prefixes" spelled out over their trie.
Regex engines built on automata (llguidance's) have no lookaround; both parts are regular."""

from __future__ import annotations

_META = set("\\.+*?()|[]{}^$")
_CLASS_META = set("\\]^-[")


def split_negative_prefixes(pattern: str) -> tuple[str, str] | None:
    """(the pattern less its lookahead, a pattern of the strings that start with none of its prefixes), or
    None where the pattern does not open with `^(?!` of literal alternatives."""
    if not pattern.startswith("^(?!"):
        return None
    end = _closing_paren(pattern, 4)
    if end is None:
        return None
    prefixes = [_literal(alt.removeprefix("^")) for alt in _alternatives(pattern[4:end])]
    if not prefixes or any(p is None or p == "" for p in prefixes):
        return None
    return "^" + pattern[end + 1:], "^" + _not_starting(prefixes) + "$"


def _closing_paren(pattern: str, i: int) -> int | None:
    """Index of the `)` closing the group whose body starts at i."""
    depth, in_class = 1, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _alternatives(body: str) -> list[str]:
    """The body split at its top-level `|` (literal alternatives have no groups or classes)."""
    out, cur, i = [], "", 0
    while i < len(body):
        if body[i] == "\\":
            cur += body[i:i + 2]
            i += 2
            continue
        if body[i] == "|":
            out.append(cur)
            cur = ""
        else:
            cur += body[i]
        i += 1
    return out + [cur]


def _literal(alt: str) -> str | None:
    """The text an alternative matches, where it is a literal (plain characters, escaped punctuation)."""
    out, i = "", 0
    while i < len(alt):
        c = alt[i]
        if c == "\\":
            if i + 1 >= len(alt) or alt[i + 1].isalnum():
                return None  # \d, \w, \b...: a class or an assertion, not a character
            out += alt[i + 1]
            i += 2
        elif c in _META:
            return None
        else:
            out += c
            i += 1
    return out


def _not_starting(prefixes: list[str]) -> str:
    """A regex (unanchored) of exactly the strings that start with none of `prefixes`."""
    end = object()
    trie: dict = {}
    for p in prefixes:
        node = trie
        for c in p:
            node = node.setdefault(c, {})
        node[end] = True

    def rest(node: dict) -> str:  # what may follow, having read a proper prefix of some prefix: ends here, or
        chars = sorted(c for c in node if c is not end)  # leaves the trie, or reads on where no prefix is complete
        parts = ["[^" + "".join("\\" + c if c in _CLASS_META else c for c in chars) + "][\\s\\S]*"]
        parts += [("\\" + c if c in _META else c) + rest(node[c]) for c in chars if end not in node[c]]
        return "(?:" + "|".join(parts) + ")?"

    return rest(trie)
