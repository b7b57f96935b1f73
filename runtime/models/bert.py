"""A BERT-style encoder (BERT, MiniLM, the sentence-transformers models built on them): bidirectional attention
over each request's own tokens, absolute position embeddings, post-LayerNorm layers, a GELU MLP.

It serves embeddings only: the runner gives it whole prompts (the scheduler never chunks or caches an
encoder's requests, runtime/scheduler/admission.py), and it writes no KV. Its weights stay float32 (the models
are small, and a 16-bit copy moves cosine similarities by more than 1e-3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.runtime.distributed.group import SINGLE, Group
from plait.runtime.forward.batch import FINAL_HIDDEN, current_batch
from plait.runtime.layers.linear import WeightLoader, copy_loader
from plait.runtime.model_config import ModelConfig



def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _gelu(name: str):
    if name in ("gelu", "gelu_python"):
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"hidden_act {name!r} is not supported for an encoder (gelu, gelu_new, relu)")


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.layer_id = layer_id
        self.num_heads = self.num_kv_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps  # BERT's layer_norm_eps
        self.act = _gelu(cfg.hidden_act)
        self.qkv_w, self.qkv_b = _param(3 * h, h), _param(3 * h)
        self.o_w, self.o_b = _param(h, h), _param(h)
        self.attn_norm_w, self.attn_norm_b = _param(h), _param(h)
        self.up_w, self.up_b = _param(inter, h), _param(inter)
        self.down_w, self.down_b = _param(h, inter), _param(h)
        self.out_norm_w, self.out_norm_b = _param(h), _param(h)

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        h = x.shape[1]
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).split(h, dim=-1)
        attn = _attend(q, k, v, lens, self.num_heads, self.head_dim)
        x = F.layer_norm(x + F.linear(attn, self.o_w, self.o_b), (h,), self.attn_norm_w, self.attn_norm_b, self.eps)
        mlp = F.linear(self.act(F.linear(x, self.up_w, self.up_b)), self.down_w, self.down_b)
        return F.layer_norm(x + mlp, (h,), self.out_norm_w, self.out_norm_b, self.eps)

    def weight_loaders(self) -> dict[str, WeightLoader]:
        p = f"encoder.layer.{self.layer_id}."
        h = self.qkv_w.shape[1]
        loaders: dict[str, WeightLoader] = {}
        for i, name in enumerate(("query", "key", "value")):
            rows = slice(i * h, (i + 1) * h)
            loaders[f"{p}attention.self.{name}.weight"] = copy_loader(self.qkv_w[rows])
            loaders[f"{p}attention.self.{name}.bias"] = copy_loader(self.qkv_b[rows])
        for prefix, (w, b) in {
            "attention.output.dense": (self.o_w, self.o_b),
            "attention.output.LayerNorm": (self.attn_norm_w, self.attn_norm_b),
            "intermediate.dense": (self.up_w, self.up_b),
            "output.dense": (self.down_w, self.down_b),
            "output.LayerNorm": (self.out_norm_w, self.out_norm_b),
        }.items():
            loaders[f"{p}{prefix}.weight"] = copy_loader(w)
            loaders[f"{p}{prefix}.bias"] = copy_loader(b)
        return loaders


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], heads: int, dim: int
            ) -> torch.Tensor:
    """Each request's tokens (contiguous in the flat batch, `lens` of them each) attend to all of its own:
    one SDPA call when the lengths are equal, else one per request. Padding to the longest with a mask was
    4.7x slower here (torch's masked CPU path; 32 chat messages of 5 to 250 tokens)."""
    def split(y: torch.Tensor, n: int) -> torch.Tensor:  # [.., n, heads * dim] -> [.., heads, n, dim]
        return y.unflatten(-1, (heads, dim)).transpose(-3, -2)

    if min(lens) == max(lens):
        n = lens[0]
        out = F.scaled_dot_product_attention(*(split(y.view(len(lens), n, -1), n) for y in (q, k, v)))
        return out.transpose(1, 2).reshape(-1, heads * dim)
    outs = []
    for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens)):
        n = qs.shape[0]
        outs.append(F.scaled_dot_product_attention(split(qs, n), split(ks, n), split(vs, n)).transpose(0, 1)
                    .reshape(n, heads * dim))
    return torch.cat(outs)


class BertModel(nn.Module):
    def __init__(self, cfg: ModelConfig, quant=None, max_positions: int | None = None,
                 compute_dtype: torch.dtype = torch.float32, group: Group = SINGLE):
        super().__init__()
        if group.distributed:
            raise ValueError("an encoder model runs on one rank (no tensor or expert parallelism)")
        hf = cfg.hf_config
        self.cfg = cfg
        h = cfg.hidden_size
        self.word = _param(cfg.vocab_size, h)
        self.position = _param(hf.max_position_embeddings, h)
        self.token_type = _param(max(getattr(hf, "type_vocab_size", 1), 1), h)
        self.embed_norm_w, self.embed_norm_b = _param(h), _param(h)
        self.layers = nn.ModuleList(EncoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.graph = None  # no decode steps: the runner's graph runners never take an encoder

    def weight_formats(self) -> list[str]:
        return ["float32"]

    def finish_loading(self) -> None:
        pass

    @torch.inference_mode()
    def forward(self, pool, capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, features) as LlamaForCausalLM's: no logits (one zero column per requested row: an encoder
        predicts no token), and the captured layers' outputs at every token (FINAL_HIDDEN: the last layer's)."""
        fb = current_batch()
        if fb.decode is not None or fb.extend is None:
            raise ValueError("an encoder computes whole prompts only")
        lens = fb.extend.kv_lens.tolist()
        if sum(lens) != fb.input_ids.numel():
            raise ValueError("an encoder's requests must be computed whole, from their first token")
        x = self.word[fb.input_ids] + self.position[fb.positions] + self.token_type[0]
        x = F.layer_norm(x, (self.cfg.hidden_size,), self.embed_norm_w, self.embed_norm_b, self.cfg.rms_norm_eps)
        taken: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, lens)
            taken[i] = x
        taken[FINAL_HIDDEN] = x
        logits = x.new_zeros(fb.logits_rows.numel(), 1)
        return logits, torch.cat([taken[i] for i in capture], dim=-1) if capture else None

    def weight_loaders(self) -> dict[str, WeightLoader]:
        loaders: dict[str, WeightLoader] = {
            "embeddings.word_embeddings.weight": copy_loader(self.word),
            "embeddings.position_embeddings.weight": copy_loader(self.position),
            "embeddings.token_type_embeddings.weight": copy_loader(self.token_type),
            "embeddings.LayerNorm.weight": copy_loader(self.embed_norm_w),
            "embeddings.LayerNorm.bias": copy_loader(self.embed_norm_b),
        }
        for layer in self.layers:
            loaders.update(layer.weight_loaders())
        return loaders
