"""What LoRA adapters cost a decode step: 16 greedy streams spread over 1, 4 and 8 adapters (rank 16 on the
attention and MLP projections, PEFT folders made here with random weights) against the same 16 streams on the
base model alone, in one process, rounds alternating.

    python benchmarks/bench_lora.py [--streams 16] [--tokens 64] [--rounds 3] [--rank 16] [--threads 2]
                                    [--modules q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]

Each round runs the base, then each adapter count, as one batch of `--streams` requests (the same prompts,
`--tokens` new tokens each, no EOS stop); the step time is the batch's wall time over its decode steps. Results go
to stdout and benchmarks/results/lora.md (docs/performance.md shows them).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_peers import cpu_name  # noqa: E402
from report import save_results  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(n: int, rank: int, modules: list[str], folder: str) -> list[str]:
    """`n` PEFT folders for the default model, random A and B (peft's init_lora_weights=False)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from plait.runtime.server_args import default_model_path

    path = default_model_path()
    base = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32)
    out = []
    for i in range(n):
        torch.manual_seed(i)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=rank, target_modules=modules,
                                                               init_lora_weights=False))
        out.append(os.path.join(folder, f"a{i}"))
        model.save_pretrained(out[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modules", default=",".join(MODULES))
    ap.add_argument("--results", default="lora.md", help="the results file (benchmarks/results/)")
    args = ap.parse_args()
    modules = args.modules.split(",")
    from plait import Engine

    with tempfile.TemporaryDirectory() as tmp:
        folders = make_adapters(8, args.rank, modules, tmp)
        engine = Engine(num_threads=args.threads, log_level="warning",
                        lora_paths=[f"a{i}={f}" for i, f in enumerate(folders)])
        prompts = [f"Write a short story about a {w} and the sea." for w in
                   ("cat", "dog", "lighthouse", "robot", "sailor", "whale", "storm", "child")] * (args.streams // 8 + 1)
        prompts = prompts[: args.streams]
        params = {"max_new_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
        layouts = {"base": [None] * args.streams}
        for n in (1, 4, 8):
            layouts[f"{n} adapter{'s' * (n > 1)}"] = [f"a{i % n}" for i in range(args.streams)]
        step: dict[str, list[float]] = {k: [] for k in layouts}
        load = []
        try:
            for names in layouts.values():  # warm-up: every adapter resident, every shape seen
                engine.generate(prompts, params, lora_path=names)
            for _ in range(args.rounds):
                load.append(os.getloadavg()[0])
                for label, names in layouts.items():
                    start = time.perf_counter()
                    engine.generate(prompts, params, lora_path=names)
                    step[label].append((time.perf_counter() - start) / args.tokens)
        finally:
            engine.shutdown()
    base = statistics.median(step["base"])
    lines = [f"`python benchmarks/bench_lora.py --streams {args.streams} --tokens {args.tokens} --rounds {args.rounds} "
             f"--rank {args.rank} --threads {args.threads} --modules {args.modules}` ({cpu_name()}; load average "
             f"{min(load):.2f}-"
             f"{max(load):.2f})", "",
             f"The default model (SmolLM2-135M, its defaults), {args.streams} greedy streams of {args.tokens} tokens in "
             f"one batch; adapters of rank {args.rank} on {', '.join(m.removesuffix('_proj') for m in modules)}.", "",
             "| streams over | step (ms, median of rounds) | against the base |", "|---|---|---|"]
    for label in layouts:
        med = statistics.median(step[label])
        lines.append(f"| {label} | {med * 1e3:.1f} | {med / base:.2f}x |")
    text = "\n".join(lines)
    print(text)
    save_results(args.results, text)


if __name__ == "__main__":
    main()
