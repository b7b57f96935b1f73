"""Paged attention over the KV pool in plain torch (the CPU path, and the reference for GPU kernels).

Per batch, each group (extend, decode) gathers its requests' keys once per layer through
`kv_slots` and runs one batched scaled_dot_product_attention; grouped-query heads are folded
into the query length so K/V are never repeated per query head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    batch = g.kv_slots.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv = pool.k[layer].shape[1]
    per_kv = num_heads // num_kv
    if g.q_rows is not None and batch == 1 and g.kv_slots.shape[1] == g.num_tokens:
        # one request with nothing cached: causal attention on the fresh K/V, no gather
        qh = q.view(g.num_tokens, num_kv, per_kv, head_dim).permute(1, 2, 0, 3)
        kh = k_new.transpose(0, 1).unsqueeze(1)
        vh = v_new.transpose(0, 1).unsqueeze(1)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return o.permute(2, 0, 1, 3).reshape(g.num_tokens, num_heads * head_dim)

    if g.prefix_slots is not None:
        return _cascade_decode(g, pool, layer, q, scale)
    flat = g.kv_slots.reshape(-1)
    kv_max = g.kv_slots.shape[1]
    # index_select on a flat index is several times faster than 2-D advanced indexing on CPU
    keys = pool.k[layer].index_select(0, flat).view(batch, kv_max, num_kv, head_dim).transpose(1, 2)
    values = pool.v[layer].index_select(0, flat).view(batch, kv_max, num_kv, -1).transpose(1, 2)
    if g.q_rows is None:  # decode: one query per request
        qh = q.view(batch, num_kv, per_kv, head_dim)
        o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=g.mask, scale=scale)
        return o.reshape(batch, num_heads * head_dim)
    q_max = g.q_max
    padded = q.new_zeros(batch * q_max, num_heads, head_dim)
    padded[g.q_rows] = q
    qh = padded.view(batch, q_max, num_kv, per_kv, head_dim).permute(0, 2, 3, 1, 4)
    qh = qh.reshape(batch, num_kv, per_kv * q_max, head_dim)
    o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=g.mask, scale=scale)
    o = o.view(batch, num_kv, per_kv, q_max, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(batch * q_max, num_heads * head_dim)[g.q_rows]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """SDPA that also returns the log-sum-exp of each query's scores (to merge partial attentions)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                      scale=scale)


def _cascade_decode(g: AttnGroup, pool: KVPool, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention as (shared prefix, read once, for all queries) + (each request's own suffix),
    merged with their log-sum-exps."""
    batch = g.kv_slots.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv = pool.k[layer].shape[1]
    per_kv = num_heads // num_kv
    qh = q.view(batch, num_kv, per_kv, head_dim)
    # prefix: all B * per_kv queries of a kv head against one copy of the prefix
    kp = pool.k[layer].index_select(0, g.prefix_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, P, D]
    vp = pool.v[layer].index_select(0, g.prefix_slots).transpose(0, 1).unsqueeze(0)
    qp = qh.permute(1, 0, 2, 3).reshape(1, num_kv, batch * per_kv, head_dim)
    out_p, lse_p = _flash(qp, kp, vp, None, scale)
    out_p = out_p.view(num_kv, batch, per_kv, head_dim).permute(1, 0, 2, 3)
    lse_p = lse_p.view(num_kv, batch, per_kv).permute(1, 0, 2)
    # suffix: each request's own keys
    flat = g.kv_slots.reshape(-1)
    kv_max = g.kv_slots.shape[1]
    ks = pool.k[layer].index_select(0, flat).view(batch, kv_max, num_kv, head_dim).transpose(1, 2)
    vs = pool.v[layer].index_select(0, flat).view(batch, kv_max, num_kv, -1).transpose(1, 2)
    out_s, lse_s = _flash(qh, ks, vs, g.mask.expand(batch, 1, per_kv, kv_max), scale)
    w = torch.sigmoid(lse_p - lse_s).unsqueeze(-1)  # share of the prefix in the softmax mass
    return (out_s + w * (out_p - out_s)).reshape(batch, num_heads * head_dim)
