"""The MoE grouped GEMM: for every (token, expert) pair in `sorted_ids`, C[pair] = A[row] @ B[expert].T,
optionally times the pair's router weight.

A is [rows, K] with row = pair // top_k (the hidden states for the first GEMM, top_k 1 for the second,
whose A is already one row per pair); B is [E, N, K] (a linear's [out, in] per expert); C is
[pairs, N]. Blocks come from moe_align_block_size: BLOCK_M consecutive entries of `sorted_ids` share
expert_ids[block]; padding entries (>= pairs) are skipped, and a block whose expert is -1 (on another
rank) writes zeros. `moe_gemm_ref` (torch) and `moe_gemm_triton` have the same signature; `config`
holds the Triton tile sizes (BLOCK_SIZE_M must be the block size the ids were aligned to).
"""

from __future__ import annotations

import functools
import os

import torch

# Triton 3.9's interpreter computes tl.dot of bf16/fp16 tiles wrong (it reads the raw bits as integers): under it
# the tiles are widened first, which is what a GPU's tensor cores compute too (exact products, float32 sums)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def moe_gemm_ref(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor | None,
                 sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor,
                 top_k: int, config: dict) -> None:
    block = config["BLOCK_SIZE_M"]
    used = int(num_tokens_post_padded[0])
    pairs = c.shape[0]
    ids = sorted_ids[:used].long()
    experts = expert_ids[: used // block].long().repeat_interleave(block)
    real = ids < pairs
    ids, experts = ids[real], experts[real]
    for e in torch.unique(experts).tolist():  # one matmul per expert present (a reference: plain, not fast)
        rows = ids[experts == e]
        if e < 0:
            c[rows] = 0
            continue
        out = a[rows // top_k].float() @ b[e].float().T
        if topk_weights is not None:
            out *= topk_weights.reshape(-1)[rows].float()[:, None]
        c[rows] = out.to(c.dtype)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr, N, K, pairs,
                        capacity, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                        TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_F32: tl.constexpr,
                        BLOCK_SIZE_M: tl.constexpr,
                        BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
        # grouped launch order: GROUP_SIZE_M row blocks sweep the N blocks together (B tiles stay in L2)
        pid = tl.program_id(0)
        pid_m_count = tl.cdiv(capacity, BLOCK_SIZE_M)
        pid_n_count = tl.cdiv(N, BLOCK_SIZE_N)
        in_group = GROUP_SIZE_M * pid_n_count
        first_m = (pid // in_group) * GROUP_SIZE_M
        group_m = min(pid_m_count - first_m, GROUP_SIZE_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m
        if pid_m * BLOCK_SIZE_M >= tl.load(post_pad_ptr):
            return
        offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
        ids = tl.load(sorted_ptr + offs_m)
        real = ids < pairs
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        c_ptrs = c_ptr + ids[:, None] * stride_cm + offs_n[None, :] * stride_cn
        c_mask = real[:, None] & (offs_n[None, :] < N)
        expert = tl.load(expert_ids_ptr + pid_m)
        if expert < 0:
            tl.store(c_ptrs, tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), c_ptr.dtype.element_ty), mask=c_mask)
            return
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        a_ptrs = a_ptr + (ids // TOP_K)[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            left = K - k * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=real[:, None] & (offs_k[None, :] < left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < left) & (offs_n[None, :] < N), other=0.0)
            if DOT_F32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(a, b)
            a_ptrs += BLOCK_SIZE_K * stride_ak
            b_ptrs += BLOCK_SIZE_K * stride_bk
        if MUL_WEIGHT:
            acc *= tl.load(w_ptr + ids, mask=real, other=0.0)[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

    return moe_gemm_kernel


def moe_gemm_triton(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor | None,
                    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor,
                    top_k: int, config: dict) -> None:
    import triton

    capacity = sorted_ids.shape[0]
    _, n, k = b.shape
    grid = (triton.cdiv(capacity, config["BLOCK_SIZE_M"]) * triton.cdiv(n, config["BLOCK_SIZE_N"]),)
    weights = topk_weights.reshape(-1) if topk_weights is not None else c  # unread without weights
    _kernel()[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_tokens_post_padded, n, k, c.shape[0], capacity,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        TOP_K=top_k, MUL_WEIGHT=topk_weights is not None, DOT_F32=_INTERPRETED and a.dtype != torch.float32,
        BLOCK_SIZE_M=config["BLOCK_SIZE_M"],
        BLOCK_SIZE_N=config["BLOCK_SIZE_N"], BLOCK_SIZE_K=config["BLOCK_SIZE_K"],
        GROUP_SIZE_M=config.get("GROUP_SIZE_M", 1), num_warps=config.get("num_warps", 4),
        num_stages=config.get("num_stages", 2))
