"""`plait bench`: the serving benchmark against any OpenAI-compatible server (plait, SGLang, vLLM, llama.cpp's
llama-server, a hosted API): concurrent streamed requests, then throughput, time to first token (TTFT), time
per output token (TPOT) and inter-token latency (ITL), as SGLang's bench_serving reports them.

Prompts are random words (a fixed seed gives the same prompts to every server), optionally after a shared
prefix, the case a prefix cache serves; lengths are counted in tokens by the server's own usage report.
benchmarks/bench_serving.py has the realistic workloads (real chat text, multi-turn) and the side-by-side runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue "
          "side kind head house service friend father power hour game line end member law car city community name "
          "president team minute idea kid body information back parent face others level office door health person "
          "art war history party result change morning reason research girl guy moment air teacher force education").split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="plait bench", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (its /v1 routes are used)")
    ap.add_argument("--model", default=None, help="model name sent; default: the first of the server's /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256, help="words of each prompt's own part")
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="words of a prefix every prompt starts with")
    ap.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    ap.add_argument("--ignore-eos", action="store_true", help="decode exactly --output-len tokens (an extra that "
                    "plait, SGLang, vLLM and llama-server take)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None, help="also write the summary to this file")
    ns = ap.parse_args(argv)
    if ns.num_prompts < 1 or ns.max_concurrency < 1 or ns.output_len < 1:
        ap.error("--num-prompts, --max-concurrency and --output-len must be at least 1")
    summary = asyncio.run(_run(ns))
    print(_table(summary))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


def _prompts(ns) -> list[str]:
    rng = random.Random(ns.seed)
    prefix = " ".join(rng.choice(_WORDS) for _ in range(ns.shared_prefix_len))
    return [(prefix + "\n\n" if prefix else "") + " ".join(rng.choice(_WORDS) for _ in range(ns.input_len))
            for _ in range(ns.num_prompts)]


async def _run(ns) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    base = ns.base_url.rstrip("/")
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=None) as client:
        model = ns.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(ns.max_concurrency)

        async def one(prompt: str) -> Result:
            async with gate:
                return await _request(client, ns, model, prompt)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in _prompts(ns)))
        duration = time.perf_counter() - start
    return _summarize(ns, model, results, duration)


async def _request(client, ns, model: str, prompt: str) -> Result:
    body: dict = {"model": model, "max_tokens": ns.output_len, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if ns.ignore_eos:
        body["ignore_eos"] = True
    if ns.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    out = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("error"):
                    out.error = str(event["error"])[:200]
                    return out
                if _has_text(event):
                    now = time.perf_counter()
                    if out.ttft == 0.0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                usage = event.get("usage")
                if usage:
                    out.prompt_tokens, out.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        out.error = f"{type(e).__name__}: {e}"[:200]
        return out
    out.latency = time.perf_counter() - start
    out.ok = out.ttft > 0
    if not out.ok:
        out.error = "no text came back"
    return out


def _has_text(event: dict) -> bool:
    for choice in event.get("choices") or []:
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            return True
    return False


def _summarize(ns, model: str, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = 1000.0

    def pct(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100)[q - 1] * ms if len(xs) > 1 else (xs[0] * ms if xs else 0.0)

    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "base_url": ns.base_url, "model": model, "endpoint": ns.endpoint, "completed": len(ok), "failed": len(errors),
        "first_error": errors[0] if errors else None, "max_concurrency": ns.max_concurrency,
        "duration_s": duration, "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "input_tokens": sum(r.prompt_tokens for r in ok), "cached_tokens": sum(r.cached_tokens for r in ok),
        "output_tokens": out_tokens,
        "mean_ttft_ms": statistics.fmean(ttft) * ms if ttft else 0.0, "p50_ttft_ms": pct(ttft, 50),
        "p99_ttft_ms": pct(ttft, 99), "mean_tpot_ms": statistics.fmean(tpot) * ms if tpot else 0.0,
        "p50_itl_ms": pct(itl, 50), "p99_itl_ms": pct(itl, 99),
    }


def _table(s: dict) -> str:
    rows = [("server", f"{s['base_url']} ({s['model']}, /{s['endpoint']})"),
            ("requests", f"{s['completed']} ok, {s['failed']} failed, concurrency {s['max_concurrency']}"),
            ("duration", f"{s['duration_s']:.1f} s"),
            ("throughput", f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s"),
            ("tokens", f"{s['input_tokens']} in ({s['cached_tokens']} cached), {s['output_tokens']} out"),
            ("TTFT", f"mean {s['mean_ttft_ms']:.0f} ms, p50 {s['p50_ttft_ms']:.0f}, p99 {s['p99_ttft_ms']:.0f}"),
            ("TPOT", f"mean {s['mean_tpot_ms']:.1f} ms"),
            ("ITL", f"p50 {s['p50_itl_ms']:.1f} ms, p99 {s['p99_itl_ms']:.1f}")]
    if s["first_error"]:
        rows.append(("first error", s["first_error"]))
    return "\n".join(f"{k:>12}  {v}" for k, v in rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
