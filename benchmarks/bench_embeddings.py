"""Embedding throughput and latency: a plait server on the packaged all-MiniLM-L6-v2 against sentence-transformers
running the same folder in this process (its own `encode`, batch 32, the library's defaults), rounds alternating.

    python benchmarks/bench_embeddings.py [--texts 512] [--rounds 3] [--threads 2]

The texts are user messages from the `evals` package's chat data (as the other benchmarks' prompts), cut to 256
tokens by both (sentence-transformers' max_seq_length; plait through Ollama's /api/embed, which truncates). A round
embeds every text in one call (plait: one HTTP request, batched by its scheduler), then 32 single-text calls one
after another (the latency of one query). The cosine similarity of the two sides' vectors is checked on every text.
Results go to stdout and benchmarks/results/embeddings.md (docs/models.md shows them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from bench_peers import cpu_name  # noqa: E402
from report import save_results  # noqa: E402
from server_util import Server  # noqa: E402

from plait.runtime.model_loader.packaged import fetch  # noqa: E402
from plait.train_data import _rows  # noqa: E402


def texts(n: int) -> list[str]:
    out = []
    for _, msgs in _rows(limit=50):
        text = next((m["content"] for m in msgs if m.get("role") == "user" and m["content"].strip()), None)
        if text:
            out.append(text)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} texts in the evals data")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    folder = str(fetch("all-minilm-l6-v2"))
    batch, queries = texts(args.texts), texts(args.texts + 32)[-32:]
    st = SentenceTransformer(folder, device="cpu")
    srv = Server("--model-path", folder, "--num-threads", str(args.threads))
    timings: dict[str, dict[str, list[float]]] = {"plait": {"batch": [], "single": []},
                                                  "sentence-transformers": {"batch": [], "single": []}}
    load = []
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as http:
            def plait_embed(items: list[str]) -> np.ndarray:
                r = http.post("/api/embed", json={"model": "all-minilm-l6-v2", "input": items})
                r.raise_for_status()
                return np.asarray(r.json()["embeddings"], dtype=np.float32)

            def st_embed(items: list[str]) -> np.ndarray:
                return st.encode(items, batch_size=32, convert_to_numpy=True, normalize_embeddings=True)

            sides = {"plait": plait_embed, "sentence-transformers": st_embed}
            vectors = {name: fn(batch) for name, fn in sides.items()}  # warm-up, and the agreement check
            cosine = (vectors["plait"] * vectors["sentence-transformers"]).sum(1)
            for _ in range(args.rounds):
                load.append(os.getloadavg()[0])
                for name, fn in sides.items():
                    start = time.perf_counter()
                    fn(batch)
                    timings[name]["batch"].append(time.perf_counter() - start)
                    for q in queries:
                        start = time.perf_counter()
                        fn([q])
                        timings[name]["single"].append(time.perf_counter() - start)
    finally:
        srv.stop()
    tokens = sum(len(ids) for ids in st.tokenizer(batch, truncation=True, max_length=256)["input_ids"])
    lines = [f"`python benchmarks/bench_embeddings.py --texts {args.texts} --rounds {args.rounds} "
             f"--threads {args.threads}` ({cpu_name()}; load average {min(load):.2f}-{max(load):.2f})", "",
             f"all-MiniLM-L6-v2, {len(batch)} chat messages ({tokens} tokens after truncation to 256) per batch; "
             f"plait's vectors against sentence-transformers': cosine min {cosine.min():.7f}.", "",
             "| | batch: texts/s (median of rounds) | batch: tokens/s | one text: median ms | one text: p90 ms |",
             "|---|---|---|---|---|"]
    for name, t in timings.items():
        med = statistics.median(t["batch"])
        single = sorted(t["single"])
        lines.append(f"| {name} | {len(batch) / med:.0f} | {tokens / med:.0f} | {statistics.median(single) * 1e3:.1f} "
                     f"| {single[int(0.9 * (len(single) - 1))] * 1e3:.1f} |")
    ratio = statistics.median(timings["sentence-transformers"]["batch"]) / statistics.median(timings["plait"]["batch"])
    lines += ["", f"plait's batch throughput is {ratio:.2f}x sentence-transformers' (plait's figures include HTTP and "
              "JSON both ways; sentence-transformers runs in the benchmark's process)."]
    text = "\n".join(lines)
    print(text)
    save_results("embeddings.md", text)


if __name__ == "__main__":
    main()
