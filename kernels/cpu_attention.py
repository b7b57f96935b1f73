"""Paged decode attention on CPU: a small C kernel (see cpu_build) beside its plain-torch
reference with the same signature.

The reference gathers every request's keys into a padded copy before attending; at 64 requests
x 300 tokens that copy moves ~1 GB per decode step and takes most of it. The kernel reads keys in
place through the slot table. Where no compiler is found, the reference runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from plait.kernels.cpu_build import load_library

_MIN_ROWS_PER_THREAD = 2048


def paged_decode_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               slots: torch.Tensor, lens: torch.Tensor, scale: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, G, D] (G query heads per kv head); k_pool [S, H, D], v_pool [S, H, Dv];
    slots [B, L] (request b's keys are slots[b, :lens[b]]). Returns out [B, H, G, Dv] and the
    log-sum-exp of each query's scores [B, H, G]."""
    batch, length = slots.shape
    k, v = gather_kv(k_pool, v_pool, slots)
    mask = torch.zeros(batch, 1, 1, length, dtype=q.dtype)
    mask.masked_fill_((torch.arange(length)[None, :] >= lens[:, None]).view(batch, 1, 1, length), float("-inf"))
    return attention_with_lse(q, k, v, mask, scale)


def gather_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of slots [B, L] as [B, H, L, D] (index_select on a flat index: much faster than 2-D indexing)."""
    batch, length = slots.shape
    flat = slots.reshape(-1)
    k = k_pool.index_select(0, flat).view(batch, length, *k_pool.shape[1:]).transpose(1, 2)
    v = v_pool.index_select(0, flat).view(batch, length, *v_pool.shape[1:]).transpose(1, 2)
    return k, v


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA that also returns the log-sum-exp of each query's scores (to merge partial attentions)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                      scale=scale)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           slots: torch.Tensor, lens: torch.Tensor, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as paged_decode_attention_ref; the C kernel where it applies."""
    lib = _library()
    if (lib is None or q.device.type != "cpu" or q.dtype != torch.float32 or k_pool.dtype != torch.float32
            or k_pool.stride(-1) != 1 or k_pool.stride(1) != k_pool.shape[2]
            or v_pool.stride(-1) != 1 or v_pool.stride(1) != v_pool.shape[2]):
        return paged_decode_attention_ref(q, k_pool, v_pool, slots, lens, scale)
    q = q.contiguous()
    slots = slots.contiguous()
    lens = lens.contiguous()
    batch, heads, groups, dim = q.shape
    vdim = v_pool.shape[2]
    # a second thread pays off only for enough work (waking one costs a few microseconds)
    threads = torch.get_num_threads() if batch * heads * slots.shape[1] >= _MIN_ROWS_PER_THREAD else 1
    out = torch.empty(batch, heads, groups, vdim, dtype=q.dtype)
    lse = torch.empty(batch, heads, groups, dtype=q.dtype)
    lib.paged_decode_attention(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), lens.data_ptr(), out.data_ptr(),
        lse.data_ptr(), batch, heads, groups, dim, vdim, slots.shape[1], k_pool.stride(0), v_pool.stride(0),
        scale, threads,
    )
    return out, lse


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_library("paged_decode")
    if lib is not None:
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.paged_decode_attention.argtypes = [p] * 7 + [i64] * 8 + [f32, ctypes.c_int]
        lib.paged_decode_attention.restype = None
    return lib
