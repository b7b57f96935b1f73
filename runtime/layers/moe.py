"""The sparse MLP of MoE models: a router, E experts (gate/up/down each) and an optional shared expert.

`FusedMoE` owns the experts' weights stacked per rank in SGLang's layout (w13 [E_local, 2I, H]: each
expert's gate rows then up rows; w2 [E_local, H, I]) in the model's dtype, and a loader that puts one
checkpoint tensor (`experts.{e}.gate_proj` ...) in its expert's slot. The router runs in float32
(routing flips on rounding otherwise); the experts run through plait.kernels.fused_moe (Triton on
GPU, sorted grouped matmuls on CPU).

Across ranks (a `Group`, runtime/distributed/):
- tensor parallelism: every rank holds every expert's slice of the intermediate rows; its output is
  a partial sum, reduced once with the shared expert's;
- expert parallelism (`group.ep`): a rank holds a contiguous range of whole experts (tensors of
  other ranks' experts are accepted and dropped). Each rank routes its share of the tokens, sends
  each (token, expert) pair to the expert's rank with all-to-all, runs the pairs it received,
  sends the results back (all-to-all), weights and sums them per token, and the ranks' shares of
  tokens are gathered: every rank ends with every token's output.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from plait.kernels.cpu_quant import GROUP
from plait.kernels.fused_moe import fused_experts, fused_moe, select_experts
from plait.runtime.distributed.group import SINGLE, Group, partition
from plait.runtime.layers.linear import MergedColumnLinear, RowLinear, UnquantizedMethod, copy_loader, empty_param
from plait.runtime.model_config import MoEConfig

SHARDS = ("gate", "up", "down")


class FusedMoE(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden: int, dtype: torch.dtype, group: Group = SINGLE):
        super().__init__()
        self.cfg, self.hidden, self.group = cfg, hidden, group
        self.ep = group.distributed and group.ep
        self.partial = group.distributed and not group.ep  # the output needs the caller's all-reduce
        e_all, i_all = cfg.num_experts, cfg.intermediate_size
        self.experts = partition(e_all, group.size, group.rank) if self.ep else range(e_all)
        self.inter = partition(i_all, group.size, group.rank) if self.partial else range(i_all)
        n, inter = len(self.experts), len(self.inter)
        self.w13 = empty_param(n, 2 * inter, hidden, dtype=dtype)
        self.w2 = empty_param(n, hidden, inter, dtype=dtype)
        self.router = empty_param(e_all, hidden, dtype=torch.float32)
        if self.ep:  # the rank that holds each expert
            self.owner = torch.cat([torch.full((len(partition(e_all, group.size, r)),), r, dtype=torch.int64)
                                    for r in range(group.size)])

    def expert_loader(self, tensor: torch.Tensor, expert: int, shard: str) -> None:
        full = self.cfg.intermediate_size
        want = (self.hidden, full) if shard == "down" else (full, self.hidden)
        if tuple(tensor.shape) != want:
            raise ValueError(f"expert {shard} of shape {tuple(tensor.shape)} does not fit {want}")
        if expert not in self.experts:
            return  # another rank's expert
        e, keep, inter = expert - self.experts.start, self.inter, len(self.inter)
        if shard == "down":
            self.w2.data[e].copy_(tensor[:, keep.start : keep.stop])
        else:
            start = 0 if shard == "gate" else inter
            self.w13.data[e, start : start + inter].copy_(tensor[keep.start : keep.stop])

    def weight_loaders(self, prefix: str) -> dict:
        """Checkpoint name -> loader, for the layer whose names start with `prefix` (`model.layers.3.`)."""
        p = f"{prefix}{self.cfg.router_prefix}."
        out = {p + "gate.weight": copy_loader(self.router)}
        for e in range(self.cfg.num_experts):
            for shard, name in zip(SHARDS, self.cfg.expert_names):
                out[f"{p}experts.{e}.{name}.weight"] = functools.partial(self.expert_loader, expert=e, shard=shard)
        return out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.ep:
            return self._forward_ep(h)
        logits = h.float() @ self.router.T
        out = fused_moe(h.to(self.w13.dtype), self.w13, self.w2, logits, self.cfg.top_k, self.cfg.renormalize)
        return out.to(h.dtype)

    def _forward_ep(self, h: torch.Tensor) -> torch.Tensor:
        g, top_k = self.group, self.cfg.top_k
        bounds = [r * h.shape[0] // g.size for r in range(g.size + 1)]  # each rank's share of the tokens
        x = h[bounds[g.rank] : bounds[g.rank + 1]]
        weights, ids = select_experts(x.float() @ self.router.T, top_k, self.cfg.renormalize)
        ids = ids.reshape(-1).long()
        owner = self.owner[ids]
        order = torch.argsort(owner, stable=True)  # pairs grouped by the rank that runs them
        send = torch.bincount(owner, minlength=g.size).tolist()
        token = order // top_k
        rows, got = g.all_to_all(x[token].to(self.w13.dtype), send)
        experts, _ = g.all_to_all(ids[order], send)
        local = (experts - self.experts.start).to(torch.int32)[:, None]
        # each received pair through its one expert (none received: nothing to run)
        out = fused_experts(rows, self.w13, self.w2, torch.ones(local.shape), local) if rows.shape[0] else rows
        back, _ = g.all_to_all(out, got)
        y = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32)
        y.index_add_(0, token, back.float() * weights.reshape(-1)[order, None])
        return g.all_gather(y, [bounds[r + 1] - bounds[r] for r in range(g.size)]).to(h.dtype)


class SparseMLP(nn.Module):
    """The routed experts plus, where the model has one, the shared expert with its sigmoid gate (split
    across ranks like a dense MLP; its partial sum is reduced together with the experts')."""

    def __init__(self, cfg: MoEConfig, hidden: int, dtype: torch.dtype, method_for, group: Group = SINGLE):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.moe = FusedMoE(cfg, hidden, dtype, group)
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if cfg.shared_intermediate_size:
            si = cfg.shared_intermediate_size
            keep = partition(si, group.size, group.rank, GROUP) if group.distributed else None
            self.shared_gate_up = MergedColumnLinear(hidden, {"gate": si, "up": si}, False, method_for("gate_up"),
                                                     keep_rows={"gate": keep, "up": keep} if keep else None)
            # no reduce of its own (group left single): forward reduces its sum with the experts' once
            self.shared_down = RowLinear(si, hidden, False, method_for("down"), keep)
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
        if self.shared_gate_up is None:
            return self.group.all_reduce(out) if self.moe.partial else out
        shared = self.shared_down.forward_act_mul(self.shared_gate_up(h, batch_invariant), batch_invariant)
        shared = torch.sigmoid(self.shared_gate(h, batch_invariant)) * shared
        if self.moe.partial:
            return self.group.all_reduce(out + shared)
        return out + self.group.all_reduce(shared)
