"""Paged attention over the KV pool (CPU).

Every query token reads its keys in place through its request's slot row
(plait.kernels.cpu_attention, a C kernel with a torch reference): a decode token sees the whole
row, an extend token the keys up to its own position. Grouped-query heads are folded into the
query axis so K/V are never repeated per query head. Shared prefixes take the cascade path (read
once per batch). The pool may store K/V narrower than the queries (bfloat16 under float32): every
path then attends to the stored values, so a token's keys are the same whether they were just
computed or come from the cache. A batch-invariant batch reads every key through the C kernel,
whose result for a query depends on its keys alone.

Sliding-window layers pass `window` (a query sees its last `window` keys) and Gemma 2 passes `softcap`;
both go to the kernel, so a model with either builds its batches without the cascade split
(model_runner.build_batch), whose shared-prefix pass would see keys outside a window, uncapped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.kernels import cpu_attention, cpu_isa
from plait.radix_cache.memory_pool import KVPool
from plait.runtime.forward.batch import AttnGroup, ForwardBatch


def paged_attention(fb: ForwardBatch, layer: int, pool: KVPool, q: torch.Tensor, scale: float, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """q: [T, Hq, D]; this batch's new K/V are already in the pool (cpu_fused.rope_store). Returns [T, Hq * D]."""
    num_tokens, num_heads, head_dim = q.shape
    g = fb.decode
    if fb.extend is None and g.prefix_slots is None:  # decode alone (the common step): no copy, no split
        num_kv = pool.k[layer].shape[0]
        out, _ = cpu_attention.paged_attention(q.view(num_tokens, num_kv, num_heads // num_kv, head_dim),
                                               pool.k[layer], pool.v[layer], g.kv_slots, g.kv_lens, scale,
                                               window=window, softcap=softcap)
        return out.view(num_tokens, num_heads * head_dim)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for group in (fb.extend, fb.decode):
        if group is not None:
            sl = slice(group.start, group.start + group.num_tokens)
            out[sl] = _group_attention(group, pool, layer, q[sl], fb.out_slots[sl], scale, fb.batch_invariant,
                                       window, softcap)
    return out


def _group_attention(
    g: AttnGroup, pool: KVPool, layer: int, q: torch.Tensor, new_slots: torch.Tensor, scale: float,
    batch_invariant: bool, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv = pool.k[layer].shape[0]
    per_kv = num_heads // num_kv
    fresh = g.q_req is not None and g.kv_slots.shape[0] == 1 and g.kv_slots.shape[1] == num_tokens
    # causal SDPA knows no window and no cap: only where neither changes anything
    plain = softcap <= 0 and (window <= 0 or num_tokens <= window)
    if fresh and plain and not batch_invariant:
        # one request with nothing cached: causal SDPA over its new K/V, read back as stored (rounded to
        # the pool's dtype) so they are the keys every later step of this request sees
        qh = q.view(num_tokens, num_kv, per_kv, head_dim).permute(1, 2, 0, 3)
        # expanded to every query head of the group, not broadcast: torch's fused CPU kernel takes equal head
        # counts (a broadcast falls back to its math path, twice as slow at 512 tokens)
        shape = (num_kv, per_kv, num_tokens, head_dim)
        dtype = _sdpa_dtype(q.dtype, pool.k[layer].dtype)
        k_new = pool.k[layer].index_select(1, new_slots).to(dtype).unsqueeze(1).expand(shape)
        v_new = pool.v[layer].index_select(1, new_slots).to(dtype).unsqueeze(1).expand(shape)
        o = F.scaled_dot_product_attention(qh.to(dtype), k_new, v_new, is_causal=True, scale=scale)
        return o.permute(2, 0, 1, 3).reshape(num_tokens, num_heads * head_dim).to(q.dtype)
    if g.prefix_slots is None:
        return _own_keys(g, pool, layer, q, scale, False, window, softcap).reshape(num_tokens, num_heads * head_dim)
    # cascade: every query against one copy of the shared prefix, then against its own keys; merge by LSE
    out_p, lse_p = _shared_prefix(g, pool, layer, q, scale)
    out_s, lse_s = _own_keys(g, pool, layer, q, scale, with_lse=True)
    w = torch.sigmoid(lse_p - lse_s).unsqueeze(-1)  # the prefix's share of the softmax mass
    return (out_s + w * (out_p - out_s)).reshape(num_tokens, num_heads * head_dim)


def _sdpa_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype a prompt's causal SDPA runs in: bfloat16 where the pool stores bfloat16 K/V and the CPU has bfloat16
    dot products (torch's flash kernel then multiplies natively, on AMX tiles where present: 2.0-2.9x faster at 200
    to 2,048 tokens; the queries round to bfloat16 as the many-row bfloat16 matmuls' inputs do), else the queries'."""
    native = kv_dtype is torch.bfloat16 and q_dtype is torch.float32 and cpu_isa.native_bf16()
    return torch.bfloat16 if native else q_dtype


def _own_keys(g: AttnGroup, pool: KVPool, layer: int, q: torch.Tensor, scale: float, with_lse: bool,
              window: int = 0, softcap: float = 0.0):
    """Each query against its keys in g.kv_slots. Returns out [T, Hkv, G, D] (and lse [T, Hkv, G]
    when with_lse)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = pool.k[layer].shape[0]
    qh = q.view(num_tokens, num_kv, num_heads // num_kv, head_dim)
    # decode: one query per request, reading its own row; extend: each token its request's row
    lens, rows = (g.kv_lens, None) if g.q_req is None else (g.q_kv_lens, g.q_req)
    out, lse = cpu_attention.paged_attention(qh, pool.k[layer], pool.v[layer], g.kv_slots, lens, scale, rows,
                                             window, softcap)
    return (out, lse) if with_lse else out


def _shared_prefix(g: AttnGroup, pool: KVPool, layer: int, q: torch.Tensor, scale: float):
    """All queries of the group against the shared prefix, read once: one attention with T * G queries
    per kv head. Returns out [T, Hkv, G, D], lse [T, Hkv, G]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = pool.k[layer].shape[0]
    per_kv = num_heads // num_kv
    kp = pool.k[layer].index_select(1, g.prefix_slots).unsqueeze(0).to(q.dtype)  # [1, Hkv, P, D]
    vp = pool.v[layer].index_select(1, g.prefix_slots).unsqueeze(0).to(q.dtype)
    qp = q.view(num_tokens, num_kv, per_kv, head_dim).permute(1, 0, 2, 3).reshape(1, num_kv, -1, head_dim)
    out, lse = cpu_attention.attention_with_lse(qp, kp, vp, None, scale)
    out = out.view(num_kv, num_tokens, per_kv, head_dim).permute(1, 0, 2, 3)
    return out, lse.view(num_kv, num_tokens, per_kv).permute(1, 0, 2)
