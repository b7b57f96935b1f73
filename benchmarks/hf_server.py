"""A plain transformers-based OpenAI completions server: the baseline of bench_serving.

What a team gets without a serving runtime: one `generate` call per request, one request at a
time (a lock), streaming through transformers' TextIteratorStreamer, no prefix cache.

    python benchmarks/hf_server.py --port 31000 [--model-path FILE.gguf] [--num-threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--model-path")
    ap.add_argument("--num-threads", type=int, default=2)
    ns = ap.parse_args()

    import torch
    import uvicorn
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    from plait.runtime.server_args import default_model_path

    torch.set_num_threads(ns.num_threads)
    path = ns.model_path or default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        ids = tok(body["prompt"], return_tensors="pt").input_ids
        max_new = int(body.get("max_tokens", 16))
        min_new = max_new if body.get("ignore_eos") else 0
        streamer = TextIteratorStreamer(tok, skip_prompt=True)

        def run():
            with lock, torch.no_grad():
                model.generate(ids, max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False,
                               streamer=streamer, pad_token_id=tok.eos_token_id)

        threading.Thread(target=run, daemon=True).start()
        rid = f"cmpl-{uuid.uuid4().hex}"
        usage = {"prompt_tokens": ids.shape[1], "completion_tokens": max_new, "total_tokens": ids.shape[1] + max_new}

        async def events():
            loop = asyncio.get_running_loop()
            while True:
                piece = await loop.run_in_executor(None, lambda: next(streamer, None))
                if piece is None:
                    break
                chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name,
                         "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: " + json.dumps({"id": rid, "object": "text_completion", "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream")
        text = "".join([p async for p in _pieces(streamer)])
        return JSONResponse({"id": rid, "object": "text_completion", "model": name, "usage": usage,
                             "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")


async def _pieces(streamer):
    loop = asyncio.get_running_loop()
    while (piece := await loop.run_in_executor(None, lambda: next(streamer, None))) is not None:
        yield piece


if __name__ == "__main__":
    main()
