"""Rotary position embedding: a precomputed cos/sin table in HF's rotate-half layout (applied to q and
k by kernels/cpu_fused.rope_store)."""

from __future__ import annotations

from typing import Any

import torch

from plait.kernels.cpu_fused import rotate_half_rope


def rope_inv_freq(hf_config: Any, head_dim: int, rope_theta: float) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling; scaled variants (llama3, yarn, linear, ...)
    come from transformers' rope init functions so they match the reference exactly."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return inv.float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return inv.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    """Holds the cos/sin table; `tables(positions)` gathers a batch's rows."""

    def __init__(self, hf_config: Any, head_dim: int, rope_theta: float, max_positions: int, dtype: torch.dtype):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, head_dim, rope_theta)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # HF computes angles as float32 products; do the same so logits match to ~1e-6
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a batch's positions, shaped [T, D] (gathered once per batch, not per layer)."""
        return self.cos[positions], self.sin[positions]

    def shift_keys(self, k: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """Keys already rotated for position p, rotated on to p + shift: k [..., T, D], shift [T].
        RoPE is a rotation, so this is exact up to rounding (an attention scaling stays as it was)."""
        angles = shift.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
        return rotate_half_rope(k.to(torch.float32), cos, sin)

