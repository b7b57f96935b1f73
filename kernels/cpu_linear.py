"""Few-row matmuls on CPU (decode steps): a C kernel that streams the weight once.

x, bias and y are float32; the weight is float32, bfloat16 or float16 (widened on load, float32
arithmetic), so a 16-bit weight halves the bytes a decode step reads. At batch 1 a decode step is
bound by reading the weights; torch's GEMMs (MKL, oneDNN) reach about half the read bandwidth
here for these shapes, the kernel about three quarters. Above `MAX_ROWS` rows the work is
compute-bound and oneDNN wins, except where batch invariance is asked for (`batch_invariant`):
the kernel sums every output in one fixed order whatever the number of rows.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from plait.kernels.cpu_build import FORMATS, I64, INT, PTR, load_library

MAX_ROWS = 32  # crossover against F.linear measured by benchmarks/bench_linear.py on AVX2

_BF16_BLOCKED = 3  # FMT_BF16_BLOCKED of kernels/simd_cvt.h
_BLOCK_ROWS, _BLOCK_COLS = 4, 16


def block_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight [N, K] in the kernel's blocked layout (one sequential stream per 4 rows; see
    kernels/skinny_linear.c), or None where this build has no blocked path."""
    lib = _library()
    if lib is None or w.dtype != torch.bfloat16 or w.dim() != 2 or not lib.skinny_linear_blocked_bf16():
        return None
    n, k = w.shape
    n4, k16 = n // _BLOCK_ROWS * _BLOCK_ROWS, k // _BLOCK_COLS * _BLOCK_COLS
    blocks = w[:n4].reshape(n4 // _BLOCK_ROWS, _BLOCK_ROWS, k)
    chunks = blocks[:, :, :k16].reshape(-1, _BLOCK_ROWS, k16 // _BLOCK_COLS, _BLOCK_COLS).transpose(1, 2)
    per_block = torch.cat([chunks.reshape(n4 // _BLOCK_ROWS, -1), blocks[:, :, k16:].reshape(n4 // _BLOCK_ROWS, -1)], 1)
    return torch.cat([per_block.reshape(-1), w[n4:].reshape(-1)]).view(n, k)


def linear_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: float32 arithmetic on the widened weight."""
    return F.linear(x, w.float(), b)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                  batch_invariant: bool = False, blocked: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_ref(x, w, b)` for a 2-D float32 x on CPU, by the C kernel where it applies (any row
    count when `batch_invariant`, else up to MAX_ROWS). `blocked` is `block_bf16(w)` or None."""
    lib = _library()
    if (lib is None or x.dim() != 2 or (x.shape[0] > MAX_ROWS and not batch_invariant) or x.device.type != "cpu"
            or x.dtype != torch.float32 or w.dtype not in FORMATS or not w.is_contiguous()
            or (b is not None and (b.dtype != torch.float32 or not b.is_contiguous()))):
        return linear_ref(x, w, b)
    x = x.contiguous()
    rows, cols = x.shape[0], w.shape[0]
    y = torch.empty(rows, cols, dtype=torch.float32)
    weight, fmt = (w, FORMATS[w.dtype]) if blocked is None else (blocked, _BF16_BLOCKED)
    lib.skinny_linear(x.data_ptr(), weight.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                      rows, cols, w.shape[1], fmt, torch.get_num_threads())
    return y


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_library("skinny_linear", skinny_linear=(PTR, PTR, PTR, PTR, I64, I64, I64, INT, INT),
                       skinny_linear_blocked_bf16=())
    if lib is not None:
        lib.skinny_linear_blocked_bf16.restype = ctypes.c_int
    return lib
