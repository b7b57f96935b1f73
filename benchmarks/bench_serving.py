"""Online serving benchmark: an async load generator with SGLang's bench_serving metrics.

Against any running server:
    python benchmarks/bench_serving.py --backend plait --base-url http://127.0.0.1:30000 --dataset random
    python benchmarks/bench_serving.py --backend openai --base-url http://127.0.0.1:8000 --dataset multi-turn
Side by side, one run (starts plait's server, then the plain transformers server of hf_server.py):
    python benchmarks/bench_serving.py --compare

Workloads: `random` (prompts cut from real chat text at random lengths), `generated-shared-prefix`
(groups of questions after a long shared system prompt), `multi-turn` (conversations whose every turn
resends the history). Metrics: request/input/output throughput, TTFT, TPOT and ITL (mean, median,
p99), cached prompt tokens as the server reports them. Every request decodes exactly its output
length (ignore_eos), greedy, so both servers do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from workloads import samples

from report import save_results


# ---- workloads ------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One client's requests, sent in order; for multi-turn, each prompt extends the previous one."""
    turns: list[str]
    output_len: int
    chat: bool = False  # turns are user messages to be joined with the previous answers


def text_pool(tokenizer, min_tokens: int = 200_000) -> list[int]:
    """Token ids of real chat text (the evals registry, medmcqa first), to cut prompts from."""
    from workloads import data_dir

    ids: list[int] = []
    for name in ["medmcqa", *sorted(os.listdir(data_dir()))]:
        try:
            rows = samples(name)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        for row in rows:
            for m in row.get("input", []) if isinstance(row.get("input"), list) else []:
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    ids += tokenizer.encode(m["content"] + "\n")
            if len(ids) >= min_tokens:
                return ids
    return ids


def random_workload(tok, pool: list[int], n: int, input_len: int, output_len: int, ratio: float,
                    rng: random.Random):
    convs = []
    for _ in range(n):
        length = rng.randint(max(1, int(input_len * ratio)), input_len)
        start = rng.randrange(0, len(pool) - length)
        convs.append(Conversation([tok.decode(pool[start:start + length])], output_len))
    return convs


def shared_prefix_workload(tok, pool: list[int], groups: int, per_group: int, system_len: int, question_len: int,
                           output_len: int, rng: random.Random):
    convs = []
    for g in range(groups):
        s0 = rng.randrange(0, len(pool) - system_len)
        system = tok.decode(pool[s0:s0 + system_len])
        for _ in range(per_group):
            q0 = rng.randrange(0, len(pool) - question_len)
            convs.append(Conversation([system + "\n\nQuestion: " + tok.decode(pool[q0:q0 + question_len])], output_len))
    rng.shuffle(convs)
    return convs


def multi_turn_workload(n: int, turns: int, output_len: int, rng: random.Random):
    rows = samples("medmcqa")
    convs = []
    for i in range(n):
        qs = [rows[(i * turns + t) % len(rows)]["input"][-1]["content"][:400] for t in range(turns)]
        convs.append(Conversation(qs, output_len, chat=True))
    return convs


# ---- clients ------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""


async def stream_sse(client: httpx.AsyncClient, url: str, body: dict, on_event) -> Result:
    """POST a streaming request and time it; `on_event(res, data)` folds one SSE event's JSON into res
    and returns the new text it carried (TTFT and inter-token latencies are timed on new text)."""
    res = Result(ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode()[:300]
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                new = on_event(res, json.loads(line[6:]))
                if new:
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


def _native_event(res: Result, data: dict) -> str:
    new = data["text"][len(res.text):]
    res.text = data["text"]
    meta = data["meta_info"]
    res.input_tokens, res.output_tokens = meta["prompt_tokens"], meta["completion_tokens"]
    res.cached_tokens = meta["cached_tokens"]
    return new


def openai_event(res: Result, data: dict) -> str:
    """A completions or chat-completions stream event (text or delta content; usage at the end)."""
    new = "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in data.get("choices", []))
    res.text += new
    usage = data.get("usage")
    if usage:
        res.input_tokens, res.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return new


async def send(client: httpx.AsyncClient, backend: str, prompt: str, output_len: int) -> Result:
    if backend == "plait":
        body = {"text": prompt, "stream": True,
                "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}
        return await stream_sse(client, "/generate", body, _native_event)
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    return await stream_sse(client, "/v1/completions", body, openai_event)


async def run_load(base_url: str, backend: str, convs: list[Conversation], concurrency: int, tok) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    results: list[Result] = []

    async def converse(client: httpx.AsyncClient, conv: Conversation) -> None:
        history: list[dict] = []
        for turn in conv.turns:
            if conv.chat:
                history.append({"role": "user", "content": turn})
                prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            else:
                prompt = turn
            async with sem:
                r = await send(client, backend, prompt, conv.output_len)
            results.append(r)
            if conv.chat:
                history.append({"role": "assistant", "content": r.text})

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(converse(client, c) for c in convs))
        return results, time.perf_counter() - start


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs, f: 1000 * f(xs) if xs else float("nan")  # noqa: E731
    p99 = lambda xs: sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": sum(r.input_tokens for r in ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "mean_ttft_ms": ms(ttft, statistics.mean), "median_ttft_ms": ms(ttft, statistics.median),
        "p99_ttft_ms": ms(ttft, p99),
        "mean_tpot_ms": ms(tpot, statistics.mean), "median_tpot_ms": ms(tpot, statistics.median),
        "p99_tpot_ms": ms(tpot, p99),
        "mean_itl_ms": ms(itl, statistics.mean), "median_itl_ms": ms(itl, statistics.median),
        "p99_itl_ms": ms(itl, p99),
        "input_tokens": sum(r.input_tokens for r in ok), "cached_tokens": sum(r.cached_tokens for r in ok),
    }


def build(ns, tok, pool: list[int]) -> list[Conversation]:
    rng = random.Random(ns.seed)
    if ns.dataset == "random":
        return random_workload(tok, pool, ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio, rng)
    if ns.dataset == "generated-shared-prefix":
        return shared_prefix_workload(tok, pool, ns.gsp_num_groups, ns.gsp_prompts_per_group, ns.gsp_system_prompt_len,
                                      ns.gsp_question_len, ns.gsp_output_len, rng)
    return multi_turn_workload(ns.num_prompts // ns.multi_turn_turns or 1, ns.multi_turn_turns, ns.multi_turn_output_len, rng)


# ---- servers for --compare ------------------------------------------------------------------
def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def _start(cmd: list[str], url: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd)
    _wait_healthy(url, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["plait", "openai"], default="plait")
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--dataset", choices=["random", "generated-shared-prefix", "multi-turn"], default="random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.5)
    ap.add_argument("--gsp-num-groups", type=int, default=4)
    ap.add_argument("--gsp-prompts-per-group", type=int, default=16)
    ap.add_argument("--gsp-system-prompt-len", type=int, default=1500)
    ap.add_argument("--gsp-question-len", type=int, default=64)
    ap.add_argument("--gsp-output-len", type=int, default=32)
    ap.add_argument("--multi-turn-turns", type=int, default=4)
    ap.add_argument("--multi-turn-output-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=2, help="server threads in --compare")
    ap.add_argument("--compare", action="store_true", help="plait vs the transformers server, every workload")
    ap.add_argument("--baseline-prompts", type=int, default=16, help="requests per workload for the baseline")
    ns = ap.parse_args()

    from plait.runtime.model_loader import load_tokenizer
    from plait.runtime.server_args import default_model_path

    tok = load_tokenizer(default_model_path())
    pool = text_pool(tok)
    if not ns.compare:
        convs = build(ns, tok, pool)
        results, duration = asyncio.run(run_load(ns.base_url, ns.backend, convs, ns.max_concurrency, tok))
        print(json.dumps(summarize(results, duration), indent=2))
        return

    command = "python " + " ".join(sys.argv)
    print(f"$ {command}", flush=True)
    workloads = ["random", "generated-shared-prefix", "multi-turn"]
    table: dict[str, dict[str, dict]] = {w: {} for w in workloads}
    port = 30000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    servers = {
        "plait": ([sys.executable, "-m", "plait.launch_server", "--port", str(port), "--num-threads",
                   str(ns.num_threads), "--log-level", "warning"], "plait"),
        "transformers": ([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_server.py"),
                          "--port", str(port), "--num-threads", str(ns.num_threads)], "openai"),
    }
    for name, (cmd, backend) in servers.items():
        proc = _start(cmd, url)
        try:
            for w in workloads:
                args = argparse.Namespace(**vars(ns))
                args.dataset = w
                convs = build(args, tok, pool)
                if name == "transformers":  # one request at a time: a slice of the same work
                    convs = convs[: max(1, ns.baseline_prompts // (ns.multi_turn_turns if w == "multi-turn" else 1))]
                results, duration = asyncio.run(run_load(url, backend, convs, ns.max_concurrency, tok))
                table[w][name] = summarize(results, duration)
                print(name, w, json.dumps(table[w][name]), flush=True)
                failed = [r.error for r in results if not r.ok]
                if failed:
                    sys.exit(f"{name} failed {len(failed)} requests of {w}, e.g.: {failed[0]}")
        finally:
            _stop(proc)
    lines = [f"$ {command}", "",
             "| workload | server | req/s | out tok/s | in tok/s | TTFT mean / p99 (ms) | TPOT mean (ms) | "
             "ITL median / p99 (ms) | cached / input tokens |", "|" + "---|" * 9]
    for w in workloads:
        for name, s in table[w].items():
            lines.append(f"| {w} | {name} ({s['completed']} req) | {s['request_throughput']:.2f} | "
                         f"{s['output_throughput']:.1f} | {s['input_throughput']:.0f} | "
                         f"{s['mean_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | {s['mean_tpot_ms']:.0f} | "
                         f"{s['median_itl_ms']:.0f} / {s['p99_itl_ms']:.0f} | {s['cached_tokens']} / {s['input_tokens']} |")
        p, h = table[w].get("plait"), table[w].get("transformers")
        if p and h:
            lines.append(f"| {w} | **ratio** | {p['request_throughput'] / h['request_throughput']:.1f}x | "
                         f"{p['output_throughput'] / h['output_throughput']:.1f}x | | | | | |")
    text = "\n".join(lines)
    print("\n" + text)
    save_results("serving.md", text)


if __name__ == "__main__":
    main()
