"""Paged attention over the KV pool (CPU).

Extend groups gather their requests' keys once per layer through `kv_slots` and run one batched
scaled_dot_product_attention; decode groups read keys in place (plait.kernels.cpu_attention, C
kernel with a torch reference). Grouped-query heads are folded into the query axis so K/V are
never repeated per query head. Shared prefixes take the cascade path (read once per batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.kernels.cpu_attention import attention_with_lse, gather_kv, paged_decode_attention
from plait.radix_cache.memory_pool import KVPool
from plait.runtime.forward_batch import AttnGroup, ForwardBatch


def paged_attention(
    fb: ForwardBatch, layer: int, pool: KVPool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (this batch's new tokens). Returns [T, Hq * D]."""
    pool.write(layer, fb.out_slots, k, v)
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for group in (fb.extend, fb.decode):
        if group is not None:
            sl = slice(group.start, group.start + group.num_tokens)
            out[sl] = _group_attention(group, pool, layer, q[sl], k[sl], v[sl], scale)
    return out


def _group_attention(
    g: AttnGroup, pool: KVPool, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv = pool.k[layer].shape[1]
    per_kv = num_heads // num_kv
    if g.q_rows is not None and g.kv_slots.shape[0] == 1 and g.kv_slots.shape[1] == num_tokens:
        # one request with nothing cached: causal attention on the fresh K/V, no gather
        qh = q.view(num_tokens, num_kv, per_kv, head_dim).permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(qh, k_new.transpose(0, 1).unsqueeze(1),
                                           v_new.transpose(0, 1).unsqueeze(1), is_causal=True, scale=scale)
        return o.permute(2, 0, 1, 3).reshape(num_tokens, num_heads * head_dim)
    if g.prefix_slots is None:
        return _own_keys(g, pool, layer, q, scale, with_lse=False).reshape(num_tokens, num_heads * head_dim)
    # cascade: every query against one copy of the shared prefix, then against its own keys; merge by LSE
    out_p, lse_p = _shared_prefix(g, pool, layer, q, scale)
    out_s, lse_s = _own_keys(g, pool, layer, q, scale, with_lse=True)
    w = torch.sigmoid(lse_p - lse_s).unsqueeze(-1)  # the prefix's share of the softmax mass
    return (out_s + w * (out_p - out_s)).reshape(num_tokens, num_heads * head_dim)


def _own_keys(g: AttnGroup, pool: KVPool, layer: int, q: torch.Tensor, scale: float, with_lse: bool):
    """Each request's queries against its keys in g.kv_slots. Returns out [T, Hkv, G, D]
    (and lse [T, Hkv, G] when with_lse)."""
    num_tokens, num_heads, head_dim = q.shape
    batch = g.kv_slots.shape[0]
    num_kv = pool.k[layer].shape[1]
    per_kv = num_heads // num_kv
    if g.q_rows is None:  # decode: one query per request, grouped heads as the query axis
        qh = q.view(batch, num_kv, per_kv, head_dim)
        out, lse = paged_decode_attention(qh, pool.k[layer], pool.v[layer], g.kv_slots, g.kv_lens, scale)
        return (out, lse) if with_lse else out
    keys, values = gather_kv(pool.k[layer], pool.v[layer], g.kv_slots)
    q_max = g.q_max
    padded = q.new_zeros(batch * q_max, num_heads, head_dim)
    padded[g.q_rows] = q
    qh = padded.view(batch, q_max, num_kv, per_kv, head_dim).permute(0, 2, 3, 1, 4)
    qh = qh.reshape(batch, num_kv, per_kv * q_max, head_dim)
    if with_lse:
        o, lse = attention_with_lse(qh, keys, values, g.mask, scale)
        lse = lse.view(batch, num_kv, per_kv, q_max).permute(0, 3, 1, 2).reshape(batch * q_max, num_kv, per_kv)
    else:
        o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=g.mask, scale=scale)
    o = o.view(batch, num_kv, per_kv, q_max, head_dim).permute(0, 3, 1, 2, 4).reshape(batch * q_max, num_kv,
                                                                                   per_kv, head_dim)
    return (o[g.q_rows], lse[g.q_rows]) if with_lse else o[g.q_rows]


def _shared_prefix(g: AttnGroup, pool: KVPool, layer: int, q: torch.Tensor, scale: float):
    """All queries of the group against the shared prefix, read once: one attention with T * G queries
    per kv head. Returns out [T, Hkv, G, D], lse [T, Hkv, G]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = pool.k[layer].shape[1]
    per_kv = num_heads // num_kv
    kp = pool.k[layer].index_select(0, g.prefix_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, P, D]
    vp = pool.v[layer].index_select(0, g.prefix_slots).transpose(0, 1).unsqueeze(0)
    qp = q.view(num_tokens, num_kv, per_kv, head_dim).permute(1, 0, 2, 3).reshape(1, num_kv, -1, head_dim)
    out, lse = attention_with_lse(qp, kp, vp, None, scale)
    out = out.view(num_kv, num_tokens, per_kv, head_dim).permute(1, 0, 2, 3)
    return out, lse.view(num_kv, num_tokens, per_kv).permute(1, 0, 2)
