"""Few-row float32 matmuls on CPU (decode steps): a C kernel that streams the weight once.

At batch 1 a decode step is bound by reading the weights; torch's GEMMs (MKL, oneDNN) reach about
half the read bandwidth here for these shapes, the kernel about three quarters. Above
`MAX_ROWS` rows the work is compute-bound and `F.linear` wins.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from plait.kernels.cpu_build import I64, INT, PTR, load_library

MAX_ROWS = 32  # crossover against F.linear measured by benchmarks/bench_linear.py on AVX2


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)` for 2-D float32 CPU tensors, by the C kernel where it applies."""
    lib = _library()
    if (lib is None or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.device.type != "cpu"
            or x.dtype != torch.float32 or w.dtype != torch.float32 or not w.is_contiguous()
            or (b is not None and (b.dtype != torch.float32 or not b.is_contiguous()))):
        return F.linear(x, w, b)
    x = x.contiguous()
    rows, cols = x.shape[0], w.shape[0]
    y = torch.empty(rows, cols, dtype=torch.float32)
    lib.skinny_linear(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                      rows, cols, w.shape[1], torch.get_num_threads())
    return y


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return load_library("skinny_linear", skinny_linear=(PTR, PTR, PTR, PTR, I64, I64, I64, INT))
