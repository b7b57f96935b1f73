"""MoE layer benchmark, side by side in one run.

CPU: plait's path (`fused_experts_cpu`: the (token, expert) pairs sorted by expert once, one matmul pair
per expert that has tokens) against the per-expert loop that transformers' MoE blocks run (for every
expert, a mask over all tokens, a gather, the expert's MLP, a scatter-add), at 1, 16 and 256 tokens, in
float32 and bfloat16, alternating which goes first each round. Shapes are OLMoE-1B-7B's MoE layer
(64 experts, top-8, hidden 2048, expert width 1024) unless given.

GPU (when CUDA is present): the Triton fused path against the torch reference of the same math, with
achieved TFLOP/s next to the device's peak (`--peak-tflops`, default from the device name).

    python benchmarks/bench_moe.py                     # table in results/moe.md
    python benchmarks/bench_moe.py --tokens 1,16 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
from report import RESULTS, publish  # noqa: E402
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # dense, from the data sheets


def loop_moe(x, w13, w2, weights, ids):
    """transformers' way: for each expert, find its tokens in the whole batch, run its MLP, add back."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].T
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(x.dtype)


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def cpu_rows(args) -> list[str]:
    from plait.kernels.fused_moe import fused_experts_cpu, topk_routing_ref

    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        w13 = (torch.randn(args.experts, 2 * args.inter, args.hidden, generator=g) / args.hidden**0.5).to(dtype)
        w2 = (torch.randn(args.experts, args.hidden, args.inter, generator=g) / args.inter**0.5).to(dtype)
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, generator=g).to(dtype)
            weights, ids = topk_routing_ref(torch.randn(tokens, args.experts, generator=g), args.top_k, True)
            ours = lambda: fused_experts_cpu(x, w13, w2, weights, ids)  # noqa: E731
            theirs = lambda: loop_moe(x, w13, w2, weights, ids)  # noqa: E731
            err = (ours().float() - theirs().float()).abs().max().item()
            reps = max(1, 16 // tokens) if tokens < 16 else 2
            times = {"plait": [], "loop": []}
            for r in range(args.rounds):
                for name in (("plait", "loop") if r % 2 == 0 else ("loop", "plait")):
                    times[name].append(timed(ours if name == "plait" else theirs, reps))
            a, b = statistics.median(times["plait"]), statistics.median(times["loop"])
            rows.append(f"| {str(dtype).removeprefix('torch.')} | {tokens} | {tokens / a:,.0f} | {tokens / b:,.0f} "
                        f"| {b / a:.2f}x | {err:.1e} |")
            print(rows[-1], flush=True)
    return rows


def gpu_rows(args) -> list[str]:
    from plait.kernels.fused_moe import fused_experts_ref, fused_experts_triton, topk_routing_ref

    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    rows = []
    dev, dtype = "cuda", torch.bfloat16
    w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, device=dev, dtype=dtype) / args.hidden**0.5
    w2 = torch.randn(args.experts, args.hidden, args.inter, device=dev, dtype=dtype) / args.inter**0.5
    for tokens in args.gpu_tokens:
        x = torch.randn(tokens, args.hidden, device=dev, dtype=dtype)
        weights, ids = topk_routing_ref(torch.randn(tokens, args.experts, device=dev), args.top_k, True)
        flops = 2 * tokens * args.top_k * 3 * args.hidden * args.inter
        res = {}
        for label, fn in (("triton", lambda: fused_experts_triton(x, w13, w2, weights, ids)),
                          ("reference", lambda: fused_experts_ref(x, w13, w2, weights, ids))):
            if label == "reference" and tokens * args.top_k * 3 * args.hidden * args.inter * 2 > 8e9:
                res[label] = None  # the reference gathers every pair's weights: too much memory
                continue
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            res[label] = (time.perf_counter() - t0) / 10
        tri = res["triton"]
        ref = f"{res['reference'] * 1e3:.3f}" if res["reference"] else "-"
        rows.append(f"| {tokens} | {tri * 1e3:.3f} | {ref} | {flops / tri / 1e12:.1f} | {peak or '?'} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--gpu-tokens", default="1,16,256,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--out", default=os.path.join(RESULTS, "moe.md"))
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.gpu_tokens = [int(t) for t in args.gpu_tokens.split(",")]
    torch.set_num_threads(args.threads)
    command = "python benchmarks/bench_moe.py " + " ".join(sys.argv[1:])
    load = os.getloadavg()[0]
    cpu = platform.processor() or platform.machine()
    lines = [f"$ {command}".rstrip(), "",
             f"{cpu}, {os.cpu_count()} cores, {args.threads} threads; experts {args.experts}, top-{args.top_k}, "
             f"hidden {args.hidden}, expert width {args.inter}; load average {load:.2f} before", "",
             "| dtype | tokens | plait tok/s | per-expert loop tok/s | speedup | max abs diff |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    lines += cpu_rows(args)
    lines += ["", f"load average {os.getloadavg()[0]:.2f} after"]
    if torch.cuda.is_available():
        lines += ["", f"GPU: {torch.cuda.get_device_name()} (bf16)", "",
                  "| tokens | Triton ms | reference ms | Triton TFLOP/s | peak TFLOP/s |", "|---|---|---|---|---|"]
        print("\n".join(lines[-5:]), flush=True)
        lines += gpu_rows(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\nwritten to {args.out}")
    if os.path.dirname(os.path.abspath(args.out)) == RESULTS:
        publish(os.path.basename(args.out))  # the docs page and plot that show it


if __name__ == "__main__":
    main()
