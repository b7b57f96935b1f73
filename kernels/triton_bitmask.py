"""Triton kernel: apply a packed token bitmask to logits in place (GPU; runs on CPU under
TRITON_INTERPRET=1 for tests). The torch reference is plait.runtime.constrained.bitmask."""

from __future__ import annotations

import functools

import torch

_BLOCK = 1024


@functools.cache  # jitted once, on first use, so CPU-only imports never need triton
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def apply_bitmask_kernel(logits_ptr, bitmask_ptr, vocab_size, logits_stride, bitmask_stride,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0)
        block = tl.program_id(1)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offs < vocab_size
        words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=in_vocab, other=0)
        allowed = ((words >> (offs % 32)) & 1) != 0
        tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=in_vocab & ~allowed)

    return apply_bitmask_kernel


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    import triton

    batch, vocab = logits.shape
    grid = (batch, triton.cdiv(vocab, _BLOCK))
    _kernel()[grid](logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK)
