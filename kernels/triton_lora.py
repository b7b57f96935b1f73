"""Triton kernels: LoRA's segmented low-rank product (S-LoRA / Punica's SGMV shape) for a batch whose rows run with
different adapters (GPU; runs on CPU under TRITON_INTERPRET=1 for tests). The torch reference is `lora_ref`.

    y[rows of segment s] += (x[rows] @ A[slot_s]^T) @ Bt[slot_s]

`a` [S, R, K] and `bt` [S, R, N] stack the adapters' pairs (ranks zero-padded to R, a power of two >= 16);
segments are runs of rows (`starts`, `lens`) with one adapter each (`slots`). Two passes: shrink (x A^T into
t [rows, R]) and expand (t Bt, added into y), each program a block of one segment's rows.
"""

from __future__ import annotations

import functools

import torch

_BLOCK_M, _BLOCK_K, _BLOCK_N = 16, 32, 32


@functools.cache  # jitted once, on first use, so CPU-only imports never need triton
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def shrink(x_ptr, a_ptr, t_ptr, starts_ptr, lens_ptr, slots_ptr, K, R: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        seg, mb = tl.program_id(0), tl.program_id(1)
        start, rows, slot = tl.load(starts_ptr + seg), tl.load(lens_ptr + seg), tl.load(slots_ptr + seg)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, R)
        live = offs_m < rows
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xb = tl.load(x_ptr + (start + offs_m)[:, None] * K + offs_k[None, :],
                         mask=live[:, None] & (offs_k[None, :] < K), other=0.0)
            ab = tl.load(a_ptr + slot * R * K + offs_r[None, :] * K + offs_k[:, None],
                         mask=offs_k[:, None] < K, other=0.0)  # [BLOCK_K, R]: A^T's block
            acc += tl.dot(xb, ab)
        tl.store(t_ptr + (start + offs_m)[:, None] * R + offs_r[None, :], acc, mask=live[:, None])

    @triton.jit
    def expand(t_ptr, bt_ptr, y_ptr, starts_ptr, lens_ptr, slots_ptr, N, R: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        seg, mb, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, rows, slot = tl.load(starts_ptr + seg), tl.load(lens_ptr + seg), tl.load(slots_ptr + seg)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, R)
        live = offs_m < rows
        tb = tl.load(t_ptr + (start + offs_m)[:, None] * R + offs_r[None, :], mask=live[:, None], other=0.0)
        bb = tl.load(bt_ptr + slot * R * N + offs_r[:, None] * N + offs_n[None, :], mask=offs_n[None, :] < N,
                     other=0.0)
        out = tl.dot(tb, bb)
        ptrs = y_ptr + (start + offs_m)[:, None] * N + offs_n[None, :]
        keep = live[:, None] & (offs_n[None, :] < N)
        tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0) + out, mask=keep)

    return shrink, expand


def padded_rank(r: int) -> int:
    """The stacked rank R: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, 1 << (max(r, 1) - 1).bit_length())


def stack_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, K], Bt [r, N]) pairs as the kernels' stacks a [S, R, K], bt [S, R, N], ranks zero-padded."""
    rank = padded_rank(max(a.shape[0] for a, _ in pairs))
    k, n = pairs[0][0].shape[1], pairs[0][1].shape[1]
    a = pairs[0][0].new_zeros(len(pairs), rank, k)
    bt = pairs[0][1].new_zeros(len(pairs), rank, n)
    for i, (ai, bi) in enumerate(pairs):
        a[i, : ai.shape[0]] = ai
        bt[i, : bi.shape[0]] = bi
    return a, bt


def lora_triton(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                segments: list[tuple[int, int, int]]) -> None:
    """y += each segment's product, in place; segments (start, stop, index into the stacks). x, y, a, bt float32
    contiguous."""
    import triton

    if not segments:
        return
    shrink, expand = _kernels()
    dev = x.device
    starts = torch.tensor([s for s, _, _ in segments], dtype=torch.int64, device=dev)
    lens = torch.tensor([e - s for s, e, _ in segments], dtype=torch.int64, device=dev)
    slots = torch.tensor([i for _, _, i in segments], dtype=torch.int64, device=dev)
    rank, k, n = a.shape[1], x.shape[1], y.shape[1]
    longest = int(lens.max())
    t = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=dev)
    shrink[(len(segments), triton.cdiv(longest, _BLOCK_M))](x, a, t, starts, lens, slots, k, R=rank,
                                                            BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K)
    expand[(len(segments), triton.cdiv(longest, _BLOCK_M), triton.cdiv(n, _BLOCK_N))](
        t, bt, y, starts, lens, slots, n, R=rank, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)


def lora_ref(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             segments: list[tuple[int, int, int]]) -> None:
    """The torch reference of lora_triton."""
    for start, stop, i in segments:
        y[start:stop] += (x[start:stop] @ a[i].T) @ bt[i]
