"""Fused element-wise steps of a decoder layer on CPU (C kernel, `kernels/fused_ops.c`), each with
its torch reference: rms_norm, residual add + rms_norm, silu(gate) * up. Where the kernel does not
apply (no compiler, not float32 CPU, not contiguous rows) the reference runs."""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from plait.kernels.cpu_build import F32, I64, INT, PTR, load_library


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def add_rms_norm_ref(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + y
    return s, F.rms_norm(s, (s.shape[-1],), w, eps)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    lib = _library()
    if lib is None or not _fits(x, w):
        return rms_norm_ref(x, w, eps)
    out = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y) * w). Writes the sum into x (the residual stream, owned by the caller)."""
    lib = _library()
    if lib is None or not _fits(x, w) or not _fits(y, w) or x.shape != y.shape:
        return add_rms_norm_ref(x, y, w, eps)
    out = torch.empty_like(x)
    lib.add_rms_norm(x.data_ptr(), y.data_ptr(), w.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                     torch.get_num_threads())
    return x, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    lib = _library()
    if (lib is None or gate_up.dim() != 2 or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu"
            or not gate_up.is_contiguous() or gate_up.shape[1] % 2):
        return silu_mul_ref(gate_up)
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.float32)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads())
    return out


def _fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and x.is_contiguous() and w.is_contiguous() and w.shape == (x.shape[1],))


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return load_library("fused_ops", rms_norm=(PTR, PTR, PTR, I64, I64, F32, INT),
                        add_rms_norm=(PTR, PTR, PTR, PTR, I64, I64, F32, INT), silu_mul=(PTR, PTR, I64, I64, INT))
