"""Parallel layouts side by side in one run, on the default model: one rank (all the machine's threads),
`--tp-size 2`, and `--dp-size 2` (each of the two processes gets half the threads), at batch 1 (decode of
one request) and with 16 concurrent requests, alternating the order each round and keeping the best.

On a 2-core machine this measures what splitting costs (processes synchronising every layer over gloo
on loopback); on machines with more cores per rank the same launch is what scales.

    python benchmarks/bench_parallel.py                  # table in results/parallel.md
    python benchmarks/bench_parallel.py --rounds 3 --new-tokens 128
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import platform
import time

HERE = os.path.dirname(os.path.abspath(__file__))
from report import save_results  # noqa: E402
LAYOUTS = {"1 rank": {}, "tp 2": {"tp_size": 2}, "dp 2": {"dp_size": 2}}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _run(eng, concurrency: int, new_tokens: int) -> float:
    """Output tokens per second of `concurrency` requests sent at once."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    prompts = [f"{PROMPT} (story {i})" for i in range(concurrency)]
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: eng.generate(p, params), prompts))
    elapsed = time.perf_counter() - start
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from plait import Engine

    levels = [int(c) for c in args.concurrency.split(",")]
    best: dict[tuple[str, int], float] = {}
    for rnd in range(args.rounds):
        order = list(LAYOUTS) if rnd % 2 == 0 else list(reversed(LAYOUTS))
        for name in order:
            eng = Engine(dtype=args.dtype, max_total_tokens=8192, log_level="warning", **LAYOUTS[name])
            try:
                # warm-up: a fresh engine's first few hundred decode steps run slower (measured here: a 96-token
                # request at 30, then 63, 96, 108 tok/s); each layout is measured warm
                for _ in range(3):
                    _run(eng, 1, 96)
                _run(eng, 16, 16)
                for c in levels:
                    tps = _run(eng, c, args.new_tokens)
                    best[name, c] = max(best.get((name, c), 0.0), tps)
                    print(f"round {rnd} {name:7s} concurrency {c:3d}: {tps:7.1f} tok/s", flush=True)
            finally:
                eng.shutdown()
    load = os.getloadavg()[0]
    lines = [f"# Parallel layouts on the default model ({platform.machine()}, {os.cpu_count()} cores, "
             f"dtype {args.dtype}, load {load:.2f})", "",
             f"`python benchmarks/bench_parallel.py --rounds {args.rounds} --new-tokens {args.new_tokens}`; "
             "output tokens/s, best of the rounds; ratio against 1 rank", "",
             "| layout | " + " | ".join(f"{c} concurrent" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for name in LAYOUTS:
        cells = [f"{best[name, c]:.1f} ({best[name, c] / best['1 rank', c]:.2f}x)" for c in levels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    save_results("parallel.md", table)


if __name__ == "__main__":
    main()
