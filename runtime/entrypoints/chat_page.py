"""The chat page at `/`: a page, a script and a style sheet shipped in the package (web/), no build step and no
third-party code. They carry no data, so they load without the API key; the page asks for the key when the API
refuses it, and talks to the same server's OpenAI chat API."""

from __future__ import annotations

import functools
import os

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from plait.runtime.entrypoints.common import ServerState, server_state

WEB = os.path.join(os.path.dirname(__file__), "web")
# the files `/` serves, open without the API key (http_guard.py)
PAGE_PATHS = {"/": ("index.html", "text/html; charset=utf-8"), "/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
              "/chat.css": ("chat.css", "text/css; charset=utf-8")}
# the page runs its own script and style only, and talks to this server only
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")

router = APIRouter()


@functools.lru_cache(maxsize=None)
def _read(name: str) -> bytes:
    with open(os.path.join(WEB, name), "rb") as f:
        return f.read()


def _serve(name: str, media: str, body: bytes | None = None) -> Response:
    return Response(_read(name) if body is None else body, media_type=media,
                    headers={"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
                             "Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
async def page(state: ServerState = Depends(server_state)):
    # the page asks for the key before its first call when the server wants one (no refused call to start with)
    needs_key = b'<body data-needs-key="true">' if state.args.api_key else b"<body>"
    return _serve(*PAGE_PATHS["/"], _read("index.html").replace(b"<body>", needs_key, 1))


@router.get("/chat.js", include_in_schema=False)
async def script():
    return _serve(*PAGE_PATHS["/chat.js"])


@router.get("/chat.css", include_in_schema=False)
async def style():
    return _serve(*PAGE_PATHS["/chat.css"])
