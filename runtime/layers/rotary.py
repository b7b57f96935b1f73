"""Rotary position embedding: a precomputed cos/sin table in HF's rotate-half layout (applied to q and
k by kernels/cpu_fused.rope_store), built from a RopeSpec (runtime/model_config.py)."""

from __future__ import annotations

from typing import Any

import torch

from plait.kernels.cpu_fused import rotate_half_rope
from plait.runtime.model_config import RopeSpec


def _base_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    return (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))).float()


def rope_inv_freq(hf_config: Any, head_dim: int, spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling (longrope's short factors; `longrope_tables` adds the long ones).
    The `hf` kind comes from transformers' rope init functions, so it matches the reference exactly."""
    if spec.rope_type == "hf":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = hf_config.rope_parameters
        rope_type = (params[spec.layer_type] if spec.layer_type else params).get("rope_type", "default")
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        kwargs = {"layer_type": spec.layer_type} if spec.layer_type else {}
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kwargs)
        return inv.float(), float(scaling)
    inv = _base_inv_freq(spec.theta, head_dim)
    if spec.freq_factors:
        inv = inv / torch.tensor(spec.freq_factors, dtype=torch.float32)
    if spec.rope_type == "linear":
        inv = inv / spec.factor
    elif spec.rope_type == "longrope":
        inv = inv / torch.tensor(spec.short_factors, dtype=torch.float32)
    elif spec.rope_type != "default":
        raise ValueError(f"unsupported rope_type {spec.rope_type!r}")
    return inv, spec.attention_factor if spec.rope_type == "longrope" else 1.0


class RotaryEmbedding(torch.nn.Module):
    """Holds the cos/sin table; `tables(positions)` gathers a batch's rows. `spec` None: the default rotary
    at `rope_theta`, or the scaled one `hf_config` names."""

    def __init__(self, hf_config: Any, head_dim: int, rope_theta: float, max_positions: int, dtype: torch.dtype,
                 spec: RopeSpec | None = None):
        super().__init__()
        if spec is None:
            params = getattr(hf_config, "rope_parameters", None) or {}
            scaled = params.get("rope_type", "default") != "default"
            spec = RopeSpec(rope_theta, "hf") if scaled else RopeSpec(rope_theta)
        inv_freq, scaling = rope_inv_freq(hf_config, head_dim, spec)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        positions = torch.arange(max_positions, dtype=torch.float32)
        # HF computes angles as float32 products; do the same so logits match to ~1e-6
        freqs = positions[:, None] * inv_freq[None, :]
        if spec.rope_type == "longrope" and max_positions > spec.original_max:
            long_inv = _base_inv_freq(spec.theta, head_dim) / torch.tensor(spec.long_factors, dtype=torch.float32)
            freqs[spec.original_max :] = positions[spec.original_max :, None] * long_inv[None, :]
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
