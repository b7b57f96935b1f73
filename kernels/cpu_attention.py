"""Paged attention on CPU: a small C kernel (see cpu_build) beside its plain-torch reference with
the same signature. It serves decode (one query per request) and extend (a request's new tokens,
each seeing the keys up to its own position: causal attention without a mask).

The reference gathers every query's keys into a padded copy before attending; at 64 requests
x 300 tokens that copy moves ~1 GB per decode step and takes most of it. The kernel reads keys in
place through the slot table. Where no compiler is found, the reference runs. Queries, outputs and
the arithmetic are float32; the pools may hold bfloat16 or float16 (half the bytes per key).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from plait.kernels.cpu_build import F32, FORMATS, I64, INT, PTR, load_library

_REF_CHUNK = 64


def paged_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                        lens: torch.Tensor, scale: float, rows: torch.Tensor | None = None, window: int = 0,
                        softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, G, D] (G query heads per kv head); k_pool [H, S, D], v_pool [H, S, Dv]; slots [R, L];
    query i reads slot row rows[i] (row i when rows is None) and attends to its first lens[i] keys (the last
    `window` of them where window > 0; scores soft-capped to +-softcap where softcap > 0).
    Returns out [N, H, G, Dv] and the log-sum-exp of each query's scores [N, H, G]."""
    if rows is None:
        rows = torch.arange(q.shape[0])
    outs, lses = [], []
    for i in range(0, q.shape[0], _REF_CHUNK):  # chunks bound the gathered copy
        sl = slice(i, i + _REF_CHUNK)
        length = int(lens[sl].max())
        k, v = gather_kv(k_pool, v_pool, slots.index_select(0, rows[sl])[:, :length])
        k, v = k.to(q.dtype), v.to(q.dtype)
        batch = k.shape[0]
        keys = torch.arange(length)[None, :]
        hidden = keys >= lens[sl, None]
        if window > 0:
            hidden |= keys < lens[sl, None] - window
        mask = torch.zeros(batch, 1, 1, length, dtype=q.dtype)
        mask.masked_fill_(hidden.view(batch, 1, 1, length), float("-inf"))
        out, lse = (attention_with_lse(q[sl], k, v, mask, scale) if softcap <= 0
                    else _capped_attention(q[sl], k, v, mask, scale, softcap))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse with scores soft-capped (Gemma 2), in plain torch: q [B, H, G, D], k/v [B, H, L, D]."""
    scores = torch.einsum("bhgd,bhld->bhgl", q, k) * scale
    scores = softcap * torch.tanh(scores / softcap) + mask
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("bhgl,bhld->bhgd", torch.exp(scores - lse[..., None]), v), lse


def gather_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of slots [B, L] from pools [H, S, D] as [B, H, L, D] (index_select on a flat index)."""
    batch, length = slots.shape
    flat = slots.reshape(-1)
    k = k_pool.index_select(1, flat).view(k_pool.shape[0], batch, length, -1).transpose(0, 1)
    v = v_pool.index_select(1, flat).view(v_pool.shape[0], batch, length, -1).transpose(0, 1)
    return k, v


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA that also returns the log-sum-exp of each query's scores (to merge partial attentions)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                      scale=scale)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                    lens: torch.Tensor, scale: float, rows: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as paged_attention_ref; the C kernel where it applies."""
    lib = _library()
    if (lib is None or q.device.type != "cpu" or q.dtype != torch.float32 or k_pool.dtype not in FORMATS
            or v_pool.dtype != k_pool.dtype or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1):
        return paged_attention_ref(q, k_pool, v_pool, slots, lens, scale, rows, window, softcap)
    q, slots, lens = _contiguous(q), _contiguous(slots), _contiguous(lens)
    rows = None if rows is None else _contiguous(rows)
    num_queries, heads, groups, dim = q.shape
    vdim = v_pool.shape[2]
    threads = torch.get_num_threads()  # the kernel takes fewer for little work
    out = torch.empty(num_queries, heads, groups, vdim, dtype=q.dtype)
    lse = torch.empty(num_queries, heads, groups, dtype=q.dtype)
    lib.paged_attention(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), None if rows is None else rows.data_ptr(),
        lens.data_ptr(), out.data_ptr(), lse.data_ptr(), num_queries, heads, groups, dim, vdim, slots.shape[1],
        k_pool.stride(1), v_pool.stride(1), k_pool.stride(0), v_pool.stride(0), window, scale, softcap,
        FORMATS[k_pool.dtype], threads,
    )
    return out, lse


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return load_library("paged_attention", paged_attention=(PTR,) * 8 + (I64,) * 11 + (F32, F32, INT, INT))
