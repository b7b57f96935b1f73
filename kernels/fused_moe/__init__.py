"""Fused mixture-of-experts: routing, alignment by expert, grouped GEMMs.

Each Triton kernel sits beside a plain-torch reference with the same signature (routing.py, align.py,
grouped_gemm.py, experts.py). `fused_moe` is the dispatcher a model layer calls: Triton on a GPU; on a
CPU the vectorised sorted-by-expert path (`fused_experts_cpu`) after the torch routing.
"""

from __future__ import annotations

import torch

from plait.kernels.fused_moe.align import moe_align_block_size_ref, moe_align_block_size_triton
from plait.kernels.fused_moe.experts import (act_and_mul, fused_experts_cpu, fused_experts_ref,
                                              fused_experts_triton)
from plait.kernels.fused_moe.routing import topk_routing_ref, topk_routing_triton

__all__ = ["act_and_mul", "fused_experts", "fused_experts_cpu", "fused_experts_ref", "fused_experts_triton", "fused_moe",
           "moe_align_block_size_ref", "moe_align_block_size_triton", "select_experts", "topk_routing_ref",
           "topk_routing_triton"]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
                   num_expert_group: int = 0, topk_group: int = 0,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    routing = topk_routing_triton if router_logits.is_cuda else topk_routing_ref
    return routing(router_logits, top_k, renormalize, scoring_func, num_expert_group, topk_group, correction_bias)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The experts' weighted sum for routed tokens (ids index w13/w2; -1: none): Triton on GPU, else the CPU path."""
    experts = fused_experts_triton if hidden.is_cuda else fused_experts_cpu
    return experts(hidden, w13, w2, topk_weights, topk_ids, activation)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
              renormalize: bool, activation: str = "silu", scoring_func: str = "softmax", num_expert_group: int = 0,
              topk_group: int = 0, correction_bias: torch.Tensor | None = None,
              expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer's output [T, H] (without a shared expert). `expert_map` [global experts] gives each
    global expert's index among this rank's w13/w2, or -1 where another rank holds it (expert parallelism:
    each rank sums its own experts' share; the caller reduces across ranks)."""
    weights, ids = select_experts(router_logits, top_k, renormalize, scoring_func, num_expert_group, topk_group,
                                  correction_bias)
    if expert_map is not None:
        ids = expert_map[ids.long()].to(torch.int32)
    return fused_experts(hidden, w13, w2, weights, ids, activation)
