"""`plait chat`: a terminal chat, against a running server's OpenAI API (`--url`) or on an engine in this process
(the same flags as `plait serve`). Replies stream as they are generated; the conversation is kept, so the
radix cache reuses each turn's prompt. `/reset` starts over, `/quit` (or Ctrl+D) leaves."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Iterator

from plait.runtime.server_args import ServerArgs

Send = Callable[[list[dict]], Iterator[str]]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plait chat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (e.g. http://127.0.0.1:30000); default: an engine here")
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens of one reply (default: 512)")
    parser.add_argument("--temperature", type=float, default=0.7, help="(default: 0.7)")
    ServerArgs.add_cli_args(parser)  # for the engine here; with --url, --api-key is the key sent
    ns = parser.parse_args(argv)
    params = {"max_tokens": ns.max_tokens, "temperature": ns.temperature}
    if ns.url:
        return _loop(_remote(ns.url.rstrip("/"), ns.api_key, params), ns.system)
    from plait.runtime.entrypoints.engine import Engine

    args = ServerArgs.from_cli_args(ns)
    with Engine(**{k: getattr(args, k) for k in args.__dataclass_fields__}) as engine:
        return _loop(_local(engine, params), ns.system)


def _loop(send: Send, system: str | None) -> int:
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    print("plait chat: /reset starts over, /quit leaves", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for piece in send(messages):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:  # stop this reply, keep the chat
            pass
        except Exception as e:  # noqa: BLE001 - a refused request is said and the chat goes on
            print(f"\n[error] {e}", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def _remote(url: str, api_key: str | None, params: dict) -> Send:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def send(messages: list[dict]) -> Iterator[str]:
        body = {"messages": messages, "stream": True, **params}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise RuntimeError(event["error"].get("message"))
                for choice in event.get("choices", []):
                    piece = choice["delta"].get("content")
                    if piece:
                        yield piece

    return send


def _local(engine, params: dict) -> Send:
    tok = engine.tokenizer
    sampling = {"max_new_tokens": params["max_tokens"], "temperature": params["temperature"]}

    def send(messages: list[dict]) -> Iterator[str]:
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        sent = 0
        for snap in engine.generate(prompt, sampling, stream=True):
            text = snap["text"]
            yield text[sent:]
            sent = len(text)

    return send
