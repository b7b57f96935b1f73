"""Packed token bitmasks (bit j of word w allows token 32*w + j), filled per request and
applied to a whole batch of logits in one vectorized op."""

from __future__ import annotations

import torch

from plait.runtime.constrained.base import bitmask_words

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(batch, words) int32 -> (batch, vocab) bool of allowed tokens."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def allowed_bits(row: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Whether each of `ids` is allowed in one packed row (bool, shaped like ids)."""
    return ((row[ids >> 5] >> (ids & 31)) & 1).bool()


def allow_only(bitmask: torch.Tensor, row: int, tokens: list[int]) -> None:
    """Make `row` allow exactly `tokens`."""
    bitmask[row].zero_()
    for token in tokens:
        word = int(bitmask[row, token >> 5]) | (1 << (token & 31))
        bitmask[row, token >> 5] = word - (1 << 32) if word >= 1 << 31 else word  # int32: bit 31 is the sign


def clear_bits(bitmask: torch.Tensor, row: int, tokens: list[int]) -> None:
    """Disallow `tokens` in `row`."""
    for token in tokens:
        word = (int(bitmask[row, token >> 5]) & 0xFFFFFFFF) & ~(1 << (token & 31))
        bitmask[row, token >> 5] = word - (1 << 32) if word >= 1 << 31 else word  # int32: bit 31 is the sign


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed tokens' logits to -inf, in place (rows of logits and bitmask correspond):
    the Triton kernel on GPU, the C kernel on CPU, this torch reference where neither applies."""
    if logits.is_cuda:
        from plait.kernels.triton_bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, bitmask)
        return
    from plait.kernels.cpu_bitmask import apply_token_bitmask_cpu

    if not apply_token_bitmask_cpu(logits, bitmask):
        apply_token_bitmask_ref(logits, bitmask)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))
