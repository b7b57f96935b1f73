"""Expert routing: router logits -> (top-k weights, top-k expert ids) per token.

Scores are the softmax or the sigmoid of the logits. Experts are chosen by score plus an optional
correction bias (DeepSeek-V3's `e_score_correction_bias`: it moves the choice, never the weights);
with expert groups, only the `topk_group` best groups compete (a group's score: its best expert, or
with a bias the sum of its best two). The weights are the chosen experts' scores, renormalised to sum
to one where the model says so. `topk_routing_ref` is the plain-torch reference, `topk_routing_triton`
the Triton kernel with the same signature (one program per token; GPU, or CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools

import torch


def _check(logits: torch.Tensor, top_k: int, num_expert_group: int, topk_group: int, scoring_func: str) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    experts = logits.shape[1]
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts}, got {top_k}")
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func must be softmax or sigmoid, got {scoring_func!r}")
    if num_expert_group:
        if experts % num_expert_group or not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"num_expert_group {num_expert_group} must divide {experts} experts and topk_group "
                             f"{topk_group} be in 1..{num_expert_group}")
        if top_k > topk_group * (experts // num_expert_group):
            raise ValueError(f"top_k {top_k} exceeds the experts of {topk_group} groups")


def topk_routing_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
                     num_expert_group: int = 0, topk_group: int = 0,
                     correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], ids int32 [T, top_k]), best first."""
    _check(router_logits, top_k, num_expert_group, topk_group, scoring_func)
    logits = router_logits.float()
    scores = logits.softmax(-1) if scoring_func == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, num_expert_group, experts // num_expert_group)
        group_scores = grouped.max(-1).values if correction_bias is None else grouped.topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, -1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // num_expert_group, 1), float("-inf"))
    ids = choice.topk(top_k, -1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


@functools.cache  # jitted on first use: CPU-only imports never need triton
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def routing_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                       TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SOFTMAX: tl.constexpr,
                       HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        real = offs < num_experts
        x = tl.load(logits_ptr + t * stride_t + offs, mask=real, other=float("-inf")).to(tl.float32)
        if SOFTMAX:
            p = tl.exp(x - tl.max(x, 0))
            p = p / tl.sum(p, 0)
        else:
            p = tl.where(real, tl.sigmoid(x), 0.0)
        choice = p
        if HAS_BIAS:
            choice = p + tl.load(bias_ptr + offs, mask=real, other=0.0).to(tl.float32)
        choice = tl.where(real, choice, float("-inf"))
        if GROUPS > 0:
            per_group = num_experts // GROUPS
            group = offs // per_group
            g_offs = tl.arange(0, BLOCK_G)
            g_scores = tl.full((BLOCK_G,), float("-inf"), tl.float32)
            for g in tl.static_range(GROUPS):
                members = tl.where(group == g, choice, float("-inf"))
                best = tl.max(members, 0)
                if HAS_BIAS:  # the sum of the group's best two
                    first = tl.argmax(members, 0)
                    best += tl.max(tl.where(offs == first, float("-inf"), members), 0)
                g_scores = tl.where(g_offs == g, best, g_scores)
            keep = tl.zeros((BLOCK_E,), tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                g_best = tl.argmax(g_scores, 0)
                keep = keep | (group == g_best)
                g_scores = tl.where(g_offs == g_best, float("-inf"), g_scores)
            choice = tl.where(keep & real, choice, float("-inf"))
        k_offs = tl.arange(0, BLOCK_K)
        w = tl.zeros((BLOCK_K,), tl.float32)
        ids = tl.zeros((BLOCK_K,), tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(choice, 0)
            w = tl.where(k_offs == j, tl.sum(tl.where(offs == best, p, 0.0), 0), w)
            ids = tl.where(k_offs == j, best.to(tl.int32), ids)
            choice = tl.where(offs == best, float("-inf"), choice)
        if RENORMALIZE:
            w = w / tl.sum(w, 0)
        tl.store(weights_ptr + t * TOP_K + k_offs, w, mask=k_offs < TOP_K)
        tl.store(ids_ptr + t * TOP_K + k_offs, ids, mask=k_offs < TOP_K)

    return routing_kernel


def topk_routing_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
                        num_expert_group: int = 0, topk_group: int = 0,
                        correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    _check(router_logits, top_k, num_expert_group, topk_group, scoring_func)
    tokens, experts = router_logits.shape
    logits = router_logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        bias = correction_bias if correction_bias is not None else logits  # unread without a bias
        _kernel()[(tokens,)](
            logits, bias, weights, ids, experts, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
            SOFTMAX=scoring_func == "softmax", HAS_BIAS=correction_bias is not None, GROUPS=num_expert_group or 0,
            TOPK_GROUP=topk_group or 0, BLOCK_E=triton.next_power_of_2(experts),
            BLOCK_K=triton.next_power_of_2(top_k), BLOCK_G=triton.next_power_of_2(max(num_expert_group or 1, 1)))
    return weights, ids
