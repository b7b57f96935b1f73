"""Token-bitmask application on CPU: a C kernel (the torch reference unpacks every bit, which
costs ~1.5 ms per row of a 49k vocabulary; the kernel skips whole words)."""

from __future__ import annotations

import ctypes
import functools

import torch

from plait.kernels.cpu_build import I64, PTR, load_library


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Apply in place; False where the kernel does not apply (the caller runs the reference)."""
    lib = _library()
    if (lib is None or logits.dtype != torch.float32 or bitmask.dtype != torch.int32 or logits.dim() != 2
            or logits.stride(1) != 1 or bitmask.stride(1) != 1 or logits.device.type != "cpu"):
        return False
    lib.apply_token_bitmask(logits.data_ptr(), bitmask.data_ptr(), logits.shape[0], logits.shape[1],
                            logits.stride(0), bitmask.stride(0))
    return True


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return load_library("token_bitmask", apply_token_bitmask=(PTR, PTR, I64, I64, I64, I64))
