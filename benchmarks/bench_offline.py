"""Offline throughput: plait Engine vs transformers `generate` (static batches), side by side.

Workloads (realistic prompts from the `evals` package's registry data):
  (a) 64 chat prompts x 128 new tokens
  (b) a ~1,500-token shared few-shot prefix + 64 questions x 32 new tokens
  (c) batch-1 decode tokens/s next to the memory-bandwidth bound (model bytes / copy bandwidth)

    python benchmarks/bench_offline.py [--threads 2] [--workloads a,b,c] [--variants float32,bfloat16,bfloat16+det]

plait runs once per variant (weight dtype, and +det for --enable-deterministic-inference), one
after another in the same run, so the columns compare on the same machine state. Both systems run greedy with a fixed number of new tokens (ignore_eos / min_new_tokens), so they
do the same work. Results go to stdout and, for a full run, benchmarks/results/offline.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from workloads import chat_prompts, few_shot_workload

from report import save_results


# ---- runners ------------------------------------------------------------------------------
def run_plait(engine, prompts: list[str], new_tokens: int) -> tuple[float, int, int]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    el = time.perf_counter() - t
    return el, sum(o["meta_info"]["completion_tokens"] for o in outs), sum(o["meta_info"]["cached_tokens"] for o in outs)


def run_hf(model, tokenizer, prompts: list[str], new_tokens: int, batch: int) -> tuple[float, int]:
    tokenizer.padding_side = "left"
    total = 0
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        enc = tokenizer(prompts[i : i + batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        total += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return time.perf_counter() - t, total


def copy_bandwidth() -> float:
    """Bytes copied per second by a large tensor copy (each byte read once and written once)."""
    src = torch.empty(512 * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best


def model_bytes(engine) -> int:
    """Bytes one decode step must read: every weight once (tied embeddings count once; the few
    embedding rows a step reads are within the margin)."""
    return engine.runtime.limits.weight_bytes


# ---- main ---------------------------------------------------------------------------------
def parse_variant(v: str) -> dict:
    """'float32', 'bfloat16', 'bfloat16+det' (with --enable-deterministic-inference): Engine options."""
    dtype, _, flag = v.partition("+")
    if dtype not in ("float32", "bfloat16", "float16", "auto") or flag not in ("", "det"):
        raise SystemExit(f"bad variant {v!r}: DTYPE[+det] with DTYPE float32|bfloat16|float16|auto")
    return {"dtype": dtype, "enable_deterministic_inference": flag == "det"}


def run_variant(engine, wl: list[str], num_prompts: int) -> dict[str, tuple[float, str]]:
    """workload -> (rate, text) for one engine."""
    tok = engine.tokenizer
    out: dict[str, tuple[float, str]] = {}
    if "a" in wl:
        prompts = chat_prompts(tok, num_prompts)
        engine.generate(prompts[:2], {"max_new_tokens": 2})  # warm-up
        el, n, _ = run_plait(engine, prompts, 128)
        out["a"] = (n / el, f"{n / el:.1f} tok/s ({el:.1f} s)")
    if "b" in wl:
        engine.flush_cache()
        prefix, questions = few_shot_workload(tok, num_prompts)
        el, n, cached = run_plait(engine, [prefix + q for q in questions], 32)
        out["b"] = (len(questions) / el, f"{len(questions) / el:.2f} req/s ({el:.1f} s, {cached} cached)")
    if "c" in wl:
        prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story about a dragon."}],
                                         tokenize=False, add_generation_prompt=True)
        run_plait(engine, [prompt], 8)
        mb = model_bytes(engine)
        # the machine is shared and its bandwidth drifts: each round measures the copy bandwidth right
        # before a decode run, and the median round is reported
        rounds = []
        for _ in range(5):
            bw = copy_bandwidth()
            el, n, _ = run_plait(engine, [prompt], 128)
            rounds.append((n / el / (bw / mb), n / el, bw))
        frac, tps, bw = sorted(rounds)[len(rounds) // 2]
        out["c"] = (tps, f"{tps:.1f} tok/s ({mb / 2**20:.0f} MiB/token, {100 * frac:.0f}% of {bw / mb:.0f} bound)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="a,b,c")
    ap.add_argument("--variants", default="float32,bfloat16,bfloat16+det",
                    help="plait configurations, side by side: DTYPE[+det] (+det: --enable-deterministic-inference)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--baseline-prompts", type=int, default=32,
                    help="transformers runs the first N prompts of each workload (rates are per token or request)")
    ap.add_argument("--skip-baseline", action="store_true")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    from plait import Engine
    from plait.kernels import cpu_isa
    from plait.runtime.server_args import ServerArgs, default_model_path

    command = "python " + " ".join(sys.argv)
    print(f"$ {command}", flush=True)
    load_before = os.getloadavg()[0]
    machine = f"CPU level {cpu_isa.selected()}; --dtype auto resolves to {ServerArgs().resolved().dtype}"
    print(f"{machine}; load average {load_before:.2f}", flush=True)
    wl = ns.workloads.split(",")
    variants = ns.variants.split(",")
    results: dict[str, dict[str, tuple[float, str]]] = {}
    for v in variants:
        engine = Engine(num_threads=ns.threads, max_running_requests=ns.num_prompts, log_level="warning",
                        **parse_variant(v))
        tok = engine.tokenizer
        results[v] = run_variant(engine, wl, ns.num_prompts)
        print(v, results[v], flush=True)
        engine.shutdown()

    baseline: dict[str, tuple[float, str]] = {}
    if not ns.skip_baseline:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).eval()
        hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        if "a" in wl:
            hel, hn = run_hf(hf, hf_tok, chat_prompts(tok, ns.num_prompts)[: ns.baseline_prompts], 128, ns.hf_batch)
            baseline["a"] = (hn / hel, f"{hn / hel:.1f} tok/s ({hn} tok in {hel:.1f} s)")
        if "b" in wl:
            prefix, questions = few_shot_workload(tok, ns.num_prompts)
            base = [prefix + q for q in questions][: ns.baseline_prompts]
            hel, _ = run_hf(hf, hf_tok, base, 32, ns.hf_batch)
            baseline["b"] = (len(base) / hel, f"{len(base) / hel:.2f} req/s ({len(base)} req in {hel:.1f} s)")

    names = {"a": f"(a) {ns.num_prompts} chat prompts x 128 new tokens",
             "b": f"(b) ~1.5k-token shared prefix + {ns.num_prompts} questions x 32 new tokens",
             "c": "(c) batch-1 decode, 128 tokens"}
    first = variants[0]
    header = ["workload", *[f"plait {v}" for v in variants], *[f"{v} / {first}" for v in variants[1:]]]
    if baseline:
        header += [f"transformers fp32 (batches of {ns.hf_batch})", "best plait / transformers"]
    lines = [f"$ {command}", "", f"{machine}; load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for w in wl:
        row = [names[w], *[results[v][w][1] for v in variants],
               *[f"{results[v][w][0] / results[first][w][0]:.2f}x" for v in variants[1:]]]
        if baseline:
            best = max(results[v][w][0] for v in variants)
            row += [baseline[w][1], f"{best / baseline[w][0]:.2f}x"] if w in baseline else ["", ""]
        lines.append("| " + " | ".join(row) + " |")
    table = "\n".join(lines)
    print("\n" + table)
    if set(wl) >= {"a", "b", "c"} and not ns.skip_baseline:  # partial runs never replace the full table
        save_results("offline.md", table)


if __name__ == "__main__":
    main()
