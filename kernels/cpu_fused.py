"""Fused element-wise steps of a decoder layer on CPU (C kernel, `kernels/fused_ops.c`), each with
its torch reference: rms_norm, residual add + rms_norm, per-head q/k norms, silu(gate) * up (or gelu's), and RoPE
on q and k with
the K/V store into the pool. Where the kernel does not apply (no compiler, not float32 CPU, not
contiguous rows) the reference runs."""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from plait.kernels.cpu_build import F32, FORMATS, I64, INT, PTR, load_library


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def add_rms_norm_ref(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + y
    return s, F.rms_norm(s, (s.shape[-1],), w, eps)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_store_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) D] (q, k, v heads); cos, sin [T, D]. Rotates q and k (HF's
    rotate-half RoPE), writes k and v to the pools [kv_heads, S, D] at `slots` [T] (rounded to the
    pool's dtype) and returns q [T, heads, D]."""
    t, d = qkv.shape[0], cos.shape[-1]
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    k_pool.index_copy_(1, slots, rotate_half_rope(k, cos[:, None], sin[:, None]).transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(1, slots, v.transpose(0, 1).to(v_pool.dtype))
    return rotate_half_rope(q, cos[:, None], sin[:, None])


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE of x [..., D] by cos, sin broadcastable to x."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


_STORE_FORMATS = {dtype: FORMATS[dtype] for dtype in (torch.float32, torch.bfloat16)}  # pools rope_store writes


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Same contract as rope_store_ref, in one pass (C) where it applies."""
    lib = _library()
    d = cos.shape[-1]
    if (lib is None or qkv.dtype != torch.float32 or not qkv.is_contiguous() or qkv.dim() != 2
            or cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
            or k_pool.dtype not in _STORE_FORMATS or v_pool.dtype != k_pool.dtype or d > 1024 or d % 2
            or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1):
        return rope_store_ref(qkv, cos, sin, heads, kv_heads, k_pool, v_pool, slots)
    tokens = qkv.shape[0]
    q = torch.empty(tokens, heads, d, dtype=torch.float32)
    slots = slots.contiguous()
    lib.rope_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                   slots.data_ptr(), tokens, heads, kv_heads, d, k_pool.stride(1), k_pool.stride(0), v_pool.stride(1),
                   v_pool.stride(0), _STORE_FORMATS[k_pool.dtype], torch.get_num_threads())
    return q


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


def head_rms_norm_(qkv: torch.Tensor, start: int, heads: int, w: torch.Tensor, eps: float) -> None:
    """The `heads` heads of qkv [T, width] from column `start` (each w.shape[0] wide) RMS-normed by w, in place."""
    d = w.shape[0]
    lib = _library()
    if (lib is None or qkv.dtype is not torch.float32 or qkv.dim() != 2 or not qkv.is_contiguous()
            or w.dtype is not torch.float32 or not w.is_contiguous() or start + heads * d > qkv.shape[1]):
        part = qkv[:, start : start + heads * d].view(qkv.shape[0], heads, d)
        part.copy_(F.rms_norm(part, (d,), w, eps))
        return
    lib.head_rms_norm(qkv[:, start:].data_ptr(), qkv.shape[0], qkv.shape[1], heads, d, w.data_ptr(), eps,
                      torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_mul(gate_up, "silu_mul", silu_mul_ref)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up (tanh approximation: Gemma's GeGLU)."""
    return _act_mul(gate_up, "gelu_mul", gelu_mul_ref)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for gate_up = gate | up; act is "silu" or "gelu_tanh"."""
    return silu_mul(gate_up) if act == "silu" else gelu_mul(gate_up)


def _act_mul(gate_up: torch.Tensor, fn: str, ref) -> torch.Tensor:
    lib = _library()
    if (lib is None or gate_up.dim() != 2 or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu"
            or not gate_up.is_contiguous() or gate_up.shape[1] % 2):
        return ref(gate_up)
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.float32)
    getattr(lib, fn)(gate_up.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads())
    return out


def _fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    # cheapest checks first: this runs a few times per layer per step
    return (x.dtype is torch.float32 and w.dtype is torch.float32 and x.is_cpu and x.dim() == 2
            and x.is_contiguous() and w.is_contiguous() and w.dim() == 1 and w.shape[0] == x.shape[1])


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return load_library("fused_ops", rms_norm=(PTR, PTR, PTR, I64, I64, F32, INT),
                        add_rms_norm=(PTR, PTR, PTR, PTR, I64, I64, F32, INT), silu_mul=(PTR, PTR, I64, I64, INT),
                        gelu_mul=(PTR, PTR, I64, I64, INT), head_rms_norm=(PTR, I64, I64, I64, I64, PTR, F32, INT),
                        rope_store=(PTR,) * 7 + (I64,) * 8 + (INT, INT))
