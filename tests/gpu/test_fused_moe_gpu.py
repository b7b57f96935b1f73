"""On a real GPU (skipped without CUDA): the Triton MoE kernels against their torch references, and a tiny
Mixtral from transformers whose MoE blocks run through plait's fused_moe, against its own logits.
Run with the other GPU checks by benchmarks/gpu/run_checks.sh."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [(1, 8, 2), (3, 4, 1), (7, 16, 8), (40, 64, 8), (5, 60, 4), (64, 128, 2), (1024, 64, 8), (4096, 8, 2)]


def test_routing_and_alignment_match_references_on_gpu():
    from plait.kernels.fused_moe import (moe_align_block_size_ref, moe_align_block_size_triton, topk_routing_ref,
                                         topk_routing_triton)

    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens, experts, top_k in SHAPES:
        logits = torch.randn(tokens, experts, device="cuda", generator=g)
        for scoring in ("softmax", "sigmoid"):
            a, b = (f(logits, top_k, True, scoring) for f in (topk_routing_ref, topk_routing_triton))
            assert torch.equal(a[1], b[1])
            torch.testing.assert_close(a[0], b[0])
        ids = torch.randint(0, experts, (tokens, top_k), device="cuda", generator=g, dtype=torch.int32)
        for block in (16, 64):
            for x, y in zip(moe_align_block_size_ref(ids, block, experts), moe_align_block_size_triton(ids, block, experts)):
                assert torch.equal(x, y)
    logits, bias = torch.randn(300, 256, device="cuda", generator=g), torch.randn(256, device="cuda", generator=g) * 0.1
    a, b = (f(logits, 8, True, "sigmoid", 8, 4, bias) for f in (topk_routing_ref, topk_routing_triton))
    assert torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_match_reference_on_gpu(dtype):
    from plait.kernels.fused_moe import fused_experts_ref, fused_experts_triton, topk_routing_ref

    g = torch.Generator(device="cuda").manual_seed(1)
    tol = 2e-3 if dtype == torch.float32 else 3e-2  # fp32 tl.dot may use TF32
    for tokens, experts, top_k in SHAPES:
        h, inter = 256, 160
        x = torch.randn(tokens, h, device="cuda", generator=g).to(dtype)
        w13 = (torch.randn(experts, 2 * inter, h, device="cuda", generator=g) / h**0.5).to(dtype)
        w2 = (torch.randn(experts, h, inter, device="cuda", generator=g) / inter**0.5).to(dtype)
        w, ids = topk_routing_ref(torch.randn(tokens, experts, device="cuda", generator=g), top_k, True)
        ref = fused_experts_ref(x, w13, w2, w, ids).float()
        out = fused_experts_triton(x, w13, w2, w, ids).float()
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_tiny_mixtral_end_to_end_on_gpu():
    """transformers' tiny Mixtral with every MoE block computed by plait.kernels.fused_moe.fused_moe (Triton):
    the same logits as transformers' own experts."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from plait.kernels.fused_moe import fused_moe

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(cfg).cuda().eval()
    ids = torch.randint(0, 512, (2, 48), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits
        for layer in model.model.layers:
            block = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
            state = {k: v for k, v in block.state_dict().items()}
            w13, w2, router = _mixtral_weights(state, cfg)

            def forward(hidden, w13=w13, w2=w2, router=router):
                flat = hidden.reshape(-1, hidden.shape[-1])
                out = fused_moe(flat, w13, w2, flat.float() @ router.T, cfg.num_experts_per_tok, True)
                return out.view_as(hidden)

            block.forward = forward
        ours = model(ids).logits
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=2e-3)


def _mixtral_weights(state: dict, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack a Mixtral block's experts in SGLang's layout, from either transformers layout."""
    router = state["gate.weight"].float()
    if "experts.gate_up_proj" in state:  # transformers 5's fused experts: [E, 2I, H] (or [E, H, 2I])
        gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
        if gate_up.shape[1] == cfg.hidden_size:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        return gate_up.contiguous(), down.contiguous(), router
    e = range(cfg.num_local_experts)
    w13 = torch.stack([torch.cat([state[f"experts.{i}.w1.weight"], state[f"experts.{i}.w3.weight"]]) for i in e])
    w2 = torch.stack([state[f"experts.{i}.w2.weight"] for i in e])
    return w13, w2, router
