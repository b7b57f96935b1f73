"""One parametrised decoder for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3.

Differences are config switches (qkv bias, per-head q/k norm, tied embeddings, rope scaling).
Q/K/V and gate/up projections are fused into single matrices: fewer, larger matmuls.
Positions and KV slots come from the active ForwardBatch, not from arguments.

Two dtypes: matmul weights and the embedding are stored in `dtype` (16-bit halves the bytes a
decode step reads); activations, norms, biases and all arithmetic are in `compute_dtype`
(float32 on CPU: the kernels widen 16-bit values on load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.cpu_fused import add_rms_norm, rms_norm, rope_store, silu_mul
from plait.radix_cache.memory_pool import KVPool
from plait.runtime.model_executor.forward_batch import current_batch
from plait.runtime.layers.attention import paged_attention
from plait.runtime.layers.linear import PackedWeight, linear, pack
from plait.runtime.layers.rotary import RotaryEmbedding
from plait.runtime.model_config import ModelConfig


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


_MATMULS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, compute_dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.eps = cfg.rms_norm_eps
        self.scale = d**-0.5
        self.input_norm = _param(h, dtype=compute_dtype)
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, h, dtype=dtype)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=compute_dtype) if cfg.qkv_bias else None
        self.q_norm = _param(d, dtype=compute_dtype) if cfg.qk_norm else None
        self.k_norm = _param(d, dtype=compute_dtype) if cfg.qk_norm else None
        self.o_weight = _param(h, self.q_size, dtype=dtype)
        self.post_norm = _param(h, dtype=compute_dtype)
        self.gate_up_weight = _param(2 * cfg.intermediate_size, h, dtype=dtype)
        self.down_weight = _param(h, cfg.intermediate_size, dtype=dtype)
        self.packed: dict[str, PackedWeight | None] = dict.fromkeys(_MATMULS)

    def pack_weights(self) -> None:
        """Blocked copies of the matmul weights for many-row matmuls (see layers.linear)."""
        self.packed = {name: pack(getattr(self, name)) for name in _MATMULS}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool) -> torch.Tensor:
        fb = current_batch()
        t, inv = x.shape[0], fb.batch_invariant
        hs = rms_norm(x, self.input_norm, self.eps)
        qkv = linear(hs, self.qkv_weight, self.qkv_bias, self.packed["qkv_weight"], inv)
        if self.q_norm is not None:  # per-head RMS norm of q and k before RoPE (Qwen3), in place in qkv
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            q.copy_(F.rms_norm(q, (self.head_dim,), self.q_norm, self.eps))
            k.copy_(F.rms_norm(k, (self.head_dim,), self.k_norm, self.eps))
        # RoPE on q and k and the K/V store in one pass
        q = rope_store(qkv, cos, sin, self.num_heads, self.num_kv_heads, pool.k[self.layer_id],
                       pool.v[self.layer_id], fb.out_slots)
        attn = paged_attention(fb, self.layer_id, pool, q, self.scale)
        x, hs = add_rms_norm(x, linear(attn, self.o_weight, None, self.packed["o_weight"], inv), self.post_norm,
                             self.eps)
        act = silu_mul(linear(hs, self.gate_up_weight, None, self.packed["gate_up_weight"], inv))
        return x + linear(act, self.down_weight, None, self.packed["down_weight"], inv)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, compute_dtype) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=compute_dtype)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.rope_theta, max_positions, compute_dtype)
        self.lm_head_packed: PackedWeight | None = None

    def pack_weights(self) -> None:
        """A second, blocked copy of every matmul weight for many-row matmuls on CPU (after loading)."""
        for layer in self.layers:
            layer.pack_weights()
        self.lm_head_packed = pack(self.lm_head)

    @torch.inference_mode()
    def forward(self, pool: KVPool) -> torch.Tensor:
        """Logits (float32) at the active batch's `logits_rows`."""
        fb = current_batch()
        x = F.embedding(fb.input_ids, self.embed).to(self.compute_dtype)
        cos, sin = self.rotary.tables(fb.positions)
        for layer in self.layers:
            x = layer(x, cos, sin, pool)
        x = x[fb.logits_rows]
        x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        return linear(x, self.lm_head, None, self.lm_head_packed, fb.batch_invariant).float()

    def weight_slots(self) -> dict[str, tuple[torch.Tensor, int]]:
        """HF tensor name -> (destination parameter, row offset into it)."""
        cfg = self.cfg
        slots: dict[str, tuple[torch.Tensor, int]] = {
            "model.embed_tokens.weight": (self.embed, 0),
            "model.norm.weight": (self.norm, 0),
        }
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, 0)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, kv, inter = layer.q_size, layer.kv_size, cfg.intermediate_size
            slots.update({
                p + "input_layernorm.weight": (layer.input_norm, 0),
                p + "post_attention_layernorm.weight": (layer.post_norm, 0),
                p + "self_attn.q_proj.weight": (layer.qkv_weight, 0),
                p + "self_attn.k_proj.weight": (layer.qkv_weight, q),
                p + "self_attn.v_proj.weight": (layer.qkv_weight, q + kv),
                p + "self_attn.o_proj.weight": (layer.o_weight, 0),
                p + "mlp.gate_proj.weight": (layer.gate_up_weight, 0),
                p + "mlp.up_proj.weight": (layer.gate_up_weight, inter),
                p + "mlp.down_proj.weight": (layer.down_weight, 0),
            })
            if layer.qkv_bias is not None:
                slots[p + "self_attn.q_proj.bias"] = (layer.qkv_bias, 0)
                slots[p + "self_attn.k_proj.bias"] = (layer.qkv_bias, q)
                slots[p + "self_attn.v_proj.bias"] = (layer.qkv_bias, q + kv)
            if layer.q_norm is not None:
                slots[p + "self_attn.q_norm.weight"] = (layer.q_norm, 0)
                slots[p + "self_attn.k_norm.weight"] = (layer.k_norm, 0)
        return slots
