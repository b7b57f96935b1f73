"""Tune the Triton MoE GEMM's tiles on the GPU at hand and write kernels/fused_moe/configs JSON files.

For each token count M, every candidate config runs the whole expert computation (`fused_experts_triton`:
both grouped GEMMs) on random weights of the given shape; the fastest (median of CUDA-event timings) is
kept, after checking its output against the torch reference. The file is named by
`plait.kernels.fused_moe.config.config_file_name` (experts, expert width, device name, dtype), which is
where `get_config` looks.

    python benchmarks/gpu/tune_fused_moe.py                       # OLMoE's shape, bf16
    python benchmarks/gpu/tune_fused_moe.py --experts 8 --hidden 4096 --inter 14336 --top-k 2 --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch


def candidates(quick: bool) -> list[dict]:
    ms, ns, ks = ([16, 64], [64, 128], [64, 128]) if quick else ([16, 32, 64, 128], [32, 64, 128, 256], [32, 64, 128, 256])
    out = []
    for m, n, k, group, warps, stages in itertools.product(ms, ns, ks, [1, 8] if not quick else [8], [4, 8],
                                                           [2, 3, 4] if not quick else [3]):
        if m * k + k * n > 64 * 1024 * (2 if stages < 4 else 1):  # shared memory per stage
            continue
        out.append({"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": group,
                    "num_warps": warps, "num_stages": stages})
    return out


def time_config(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    from plait.kernels.fused_moe import fused_experts_ref, fused_experts_triton, topk_routing_ref
    from plait.kernels.fused_moe.config import CONFIG_DIR, config_file_name

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--quick", action="store_true", help="a small candidate set (a few minutes in all)")
    ap.add_argument("--out-dir", default=str(CONFIG_DIR))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    w13 = (torch.randn(args.experts, 2 * args.inter, args.hidden, device=dev) / args.hidden**0.5).to(dtype)
    w2 = (torch.randn(args.experts, args.hidden, args.inter, device=dev) / args.inter**0.5).to(dtype)
    best: dict[str, dict] = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, args.hidden, device=dev).to(dtype)
        weights, ids = topk_routing_ref(torch.randn(tokens, args.experts, device=dev), args.top_k, True)
        ref = fused_experts_ref(x, w13, w2, weights, ids).float() if tokens <= 256 else None
        results = []
        for cfg in candidates(args.quick):
            try:
                out = fused_experts_triton(x, w13, w2, weights, ids, config=cfg)
                if ref is not None and not torch.allclose(out.float(), ref, atol=5e-2, rtol=5e-2):
                    continue
                results.append((time_config(lambda: fused_experts_triton(x, w13, w2, weights, ids, config=cfg)), cfg))
            except Exception as e:  # a config the compiler refuses (resources): skip it
                print(f"  skip {cfg}: {type(e).__name__}")
        ms, cfg = min(results, key=lambda r: r[0])
        flops = 2 * tokens * args.top_k * 3 * args.hidden * args.inter
        print(f"M={tokens}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s  {cfg}", flush=True)
        best[str(tokens)] = cfg
    name = config_file_name(args.experts, args.inter, torch.cuda.get_device_name(), args.dtype)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, name), "w") as f:
        json.dump(best, f, indent=2)
    print(f"written {os.path.join(args.out_dir, name)}")


if __name__ == "__main__":
    main()
