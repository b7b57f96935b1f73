"""Reading JSON text a character at a time: where its strings open and close (escapes included). The closing
search (what a text leaves open) and UniqueKeys (the keys each object holds) both read output this way."""

from __future__ import annotations

OPEN, CLOSE, INSIDE, OUTSIDE = "open", "close", "inside", "outside"


class StringScan:
    """Whether the text read so far is inside a string, and just after a backslash in it."""

    __slots__ = ("in_string", "escaped")

    def __init__(self, in_string: bool = False, escaped: bool = False):
        self.in_string, self.escaped = in_string, escaped

    def step(self, ch: str) -> str:
        """Read one character; returns its role: OPEN (the quote opening a string), CLOSE (the quote closing it),
        INSIDE (a character of a string, escapes and escaped characters included) or OUTSIDE."""
        if not self.in_string:
            if ch == '"':
                self.in_string = True
                return OPEN
            return OUTSIDE
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            return CLOSE
        return INSIDE
