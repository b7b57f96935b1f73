"""Embedding requests: the final hidden states of a request's prompt, pooled chunk by chunk as forwards compute
them. The one writer of `Req.embedding`.

- last: the last token's state (a decoder's summary of the whole prompt; its prefix may come from the cache);
- mean: the mean over every token (all computed for this request: none may come from the cache);
- cls: the first token's (an encoder's [CLS]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Embedding:
    pooling: str  # last | mean | cls
    total: torch.Tensor | None = None  # mean: the sum so far
    vector: torch.Tensor | None = None  # the pooled state, once the prompt is computed

    @property
    def whole_prompt(self) -> bool:
        """Whether every prompt token's state is needed (none of them may come from the cache)."""
        return self.pooling != "last"


def pool_chunk(emb: Embedding, start: int, hidden: torch.Tensor, prompt_len: int) -> None:
    """Fold in the states `hidden` ([n, H], float32) of the prompt's tokens from position `start` on."""
    end = start + hidden.shape[0]
    if emb.pooling == "mean":
        chunk = hidden.sum(0)
        emb.total = chunk if start == 0 else emb.total + chunk  # a recomputed prompt (a retraction) starts over
        if end == prompt_len:
            emb.vector = emb.total / prompt_len
    elif emb.pooling == "cls":
        if start == 0:
            emb.vector = hidden[0].clone()
    elif end == prompt_len:
        emb.vector = hidden[-1].clone()
