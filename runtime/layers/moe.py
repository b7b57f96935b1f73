"""The sparse MLP of MoE models: a router, E experts (gate/up/down each) and an optional shared expert.

`FusedMoE` owns the experts' weights stacked per rank in SGLang's layout (w13 [E_local, 2I, H]: each
expert's gate rows then up rows; w2 [E_local, H, I]) in the model's dtype, and a loader that puts one
checkpoint tensor (`experts.{e}.gate_proj` ...) in its expert's slot. Under expert parallelism a rank
holds a contiguous range of experts (`expert_range`); tensors of other ranks' experts are accepted and
dropped, and the forward's `expert_map` sends their tokens nowhere (the sum over ranks is the caller's
all-reduce). The router runs in float32 (routing flips on rounding otherwise); the experts run through
plait.kernels.fused_moe (Triton on GPU, sorted grouped matmuls on CPU).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from plait.kernels.fused_moe import fused_moe
from plait.runtime.layers.linear import MergedColumnLinear, RowLinear, UnquantizedMethod, copy_loader, empty_param
from plait.runtime.model_config import MoEConfig

SHARDS = ("gate", "up", "down")


class FusedMoE(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden: int, dtype: torch.dtype, expert_range: range | None = None):
        super().__init__()
        self.cfg, self.hidden = cfg, hidden
        self.experts = expert_range if expert_range is not None else range(cfg.num_experts)
        n, inter = len(self.experts), cfg.intermediate_size
        self.w13 = empty_param(n, 2 * inter, hidden, dtype=dtype)
        self.w2 = empty_param(n, hidden, inter, dtype=dtype)
        self.router = empty_param(cfg.num_experts, hidden, dtype=torch.float32)
        if len(self.experts) == cfg.num_experts:
            self.expert_map = None
        else:
            self.expert_map = torch.full((cfg.num_experts,), -1, dtype=torch.int32)
            self.expert_map[self.experts.start : self.experts.stop] = torch.arange(n, dtype=torch.int32)

    def expert_loader(self, tensor: torch.Tensor, expert: int, shard: str) -> None:
        inter = self.cfg.intermediate_size
        want = (self.hidden, inter) if shard == "down" else (inter, self.hidden)
        if tuple(tensor.shape) != want:
            raise ValueError(f"expert {shard} of shape {tuple(tensor.shape)} does not fit {want}")
        if expert not in self.experts:
            return  # another rank's expert
        e = expert - self.experts.start
        if shard == "down":
            self.w2.data[e].copy_(tensor)
        else:
            start = 0 if shard == "gate" else inter
            self.w13.data[e, start : start + inter].copy_(tensor)

    def weight_loaders(self, prefix: str) -> dict:
        """Checkpoint name -> loader, for the layer whose names start with `prefix` (`model.layers.3.`)."""
        p = f"{prefix}{self.cfg.router_prefix}."
        out = {p + "gate.weight": copy_loader(self.router)}
        for e in range(self.cfg.num_experts):
            for shard, name in zip(SHARDS, self.cfg.expert_names):
                out[f"{p}experts.{e}.{name}.weight"] = functools.partial(self.expert_loader, expert=e, shard=shard)
        return out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = h.float() @ self.router.T
        out = fused_moe(h.to(self.w13.dtype), self.w13, self.w2, logits, self.cfg.top_k, self.cfg.renormalize,
                        expert_map=self.expert_map)
        return out.to(h.dtype)


class SparseMLP(nn.Module):
    """The routed experts plus, where the model has one, the shared expert with its sigmoid gate."""

    def __init__(self, cfg: MoEConfig, hidden: int, dtype: torch.dtype, method_for,
                 expert_range: range | None = None):
        super().__init__()
        self.cfg = cfg
        self.moe = FusedMoE(cfg, hidden, dtype, expert_range)
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if cfg.shared_intermediate_size:
            si = cfg.shared_intermediate_size
            self.shared_gate_up = MergedColumnLinear(hidden, {"gate": si, "up": si}, False, method_for("gate_up"))
            self.shared_down = RowLinear(si, hidden, False, method_for("down"))
            self.shared_gate = RowLinear(hidden, 1, False, UnquantizedMethod(torch.float32, packed=False))

    def linears(self) -> list[nn.Module]:
        return [m for m in (self.shared_gate_up, self.shared_down, self.shared_gate) if m is not None]

    def weight_loaders(self, prefix: str) -> dict:
        out = self.moe.weight_loaders(prefix)
        if self.shared_gate_up is not None:
            p = f"{prefix}{self.cfg.router_prefix}."
            for x in ("gate", "up"):
                out[f"{p}shared_expert.{x}_proj.weight"] = functools.partial(self.shared_gate_up.weight_loader, shard=x)
            out[f"{p}shared_expert.down_proj.weight"] = self.shared_down.weight_loader
            out[f"{p}shared_expert_gate.weight"] = self.shared_gate.weight_loader
        return out

    def forward(self, h: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        out = self.moe(h)
        if self.shared_gate_up is not None:
            shared = self.shared_down.forward_silu_mul(self.shared_gate_up(h, batch_invariant), batch_invariant)
            out = out + torch.sigmoid(self.shared_gate(h, batch_invariant)) * shared
        return out
