"""The experts of an MoE layer: out[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t, j].

Weights in SGLang's layout: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]. Three versions
with one signature:
- `fused_experts_ref`: per (token, choice), gathering each pair's expert weights (the reference);
- `fused_experts_triton`: align, grouped GEMM for gate/up, activation and mul, grouped GEMM for down
  with the router weight, sum over the top-k (GPU; CPU under TRITON_INTERPRET=1);
- `fused_experts_cpu`: the pairs sorted by expert and one matmul per expert that has any (grouped matmuls
  over contiguous runs; no Python loop over tokens), in the weights' dtype (bf16 weights stay bf16,
  where the CPU's matmul is fast in it).
An id outside 0..E-1 (an expert another rank holds) contributes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.kernels.cpu_fused import silu_mul, silu_mul_ref

ACTIVATIONS = ("silu", "gelu")


def _check(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("hidden must be [T, H], w13 [E, 2I, H], w2 [E, H, I]")
    experts, two_i, h = w13.shape
    if h != hidden.shape[1] or w2.shape != (experts, h, two_i // 2) or two_i % 2:
        raise ValueError(f"shapes do not fit: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [{hidden.shape[0]}, top_k]")


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate_up = gate | up; SiLU is cpu_fused.silu_mul (one C pass for float32 on CPU, its
    torch reference elsewhere), the dense MLP's own."""
    if activation == "silu":
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _act_and_mul_ref(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return silu_mul_ref(gate_up)
    return act_and_mul(gate_up, activation)


def fused_experts_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    _check(hidden, w13, w2, topk_weights, topk_ids, activation)
    tokens, top_k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    local = (ids >= 0) & (ids < w13.shape[0])
    safe = ids.clamp(0, w13.shape[0] - 1)
    x = hidden.float().repeat_interleave(top_k, 0)
    inner = _act_and_mul_ref(torch.einsum("ph,pih->pi", x, w13[safe].float()), activation)
    out = torch.einsum("pi,phi->ph", inner, w2[safe].float())
    out *= (topk_weights.reshape(-1).float() * local)[:, None]
    return out.view(tokens, top_k, -1).sum(1).to(hidden.dtype)


def fused_experts_cpu(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    _check(hidden, w13, w2, topk_weights, topk_ids, activation)
    tokens, top_k = topk_ids.shape
    experts = w13.shape[0]
    if tokens == 1:  # decode of one sequence: its k experts in turn, no sorting
        x, out = hidden.to(w13.dtype), torch.zeros(1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        for e, w in zip(topk_ids[0].tolist(), topk_weights[0].tolist()):
            if 0 <= e < experts:
                out += (act_and_mul(x @ w13[e].T, activation) @ w2[e].T).float() * w
        return out.to(hidden.dtype)
    ids = topk_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids[(ids >= 0) & (ids < experts)], minlength=experts).tolist()
    skipped = int((ids[order] < 0).sum())  # ids < 0 sort first; ids >= E sort last and are never reached
    x = hidden[order // top_k].to(w13.dtype)
    out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1)[order].float()
    start = skipped
    for e, n in enumerate(counts):  # one matmul pair per expert with tokens: the loop is over experts
        if n:
            rows = slice(start, start + n)
            inner = act_and_mul(x[rows] @ w13[e].T, activation)
            y = (inner @ w2[e].T).float() * weights[rows, None]
            out.index_add_(0, order[rows] // top_k, y)
            start += n
    return out.to(hidden.dtype)


def fused_experts_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, activation: str = "silu",
                         config: dict | None = None) -> torch.Tensor:
    from plait.kernels.fused_moe.align import moe_align_block_size_triton
    from plait.kernels.fused_moe.config import get_config
    from plait.kernels.fused_moe.grouped_gemm import moe_gemm_triton

    _check(hidden, w13, w2, topk_weights, topk_ids, activation)
    tokens, top_k = topk_ids.shape
    experts, two_i, h = w13.shape
    if config is None:
        device = torch.cuda.get_device_name(hidden.device) if hidden.is_cuda else None
        config = get_config(tokens, experts, two_i // 2, device, str(w13.dtype).removeprefix("torch."))
    sorted_ids, expert_ids, post_pad = moe_align_block_size_triton(topk_ids, config["BLOCK_SIZE_M"], experts)
    pairs = tokens * top_k
    gate_up = torch.empty(pairs, two_i, dtype=hidden.dtype, device=hidden.device)
    moe_gemm_triton(hidden.contiguous(), w13, gate_up, None, sorted_ids, expert_ids, post_pad, top_k, config)
    inner = act_and_mul(gate_up, activation)
    # pairs no block wrote (an expert on another rank drops its pairs in align) must read as zeros
    down = torch.zeros(pairs, h, dtype=hidden.dtype, device=hidden.device)
    moe_gemm_triton(inner, w2, down, topk_weights, sorted_ids, expert_ids, post_pad, 1, config)
    return down.view(tokens, top_k, h).sum(1)
