"""EAGLE draft heads, in the two layouts SGLang loads.

A head predicts the target's next feature from the current one and the next token's embedding, so a
chain of its steps guesses several tokens for one read of its small weights:
- EAGLE (EAGLE-1/2, `LlamaForCausalLMEagle`): `fc` [H, 2H] (+ bias) over [embedding ; feature],
  where the feature is the target's last hidden state (after its final norm); one decoder layer
  `layers.0.*` with no input norm; the target's LM head reads the layer's output directly.
- EAGLE-3 (`LlamaForCausalLMEagle3`): `fc` [H, kH] over k target layers' outputs (the residual
  stream after layers `eagle_aux_hidden_state_layer_ids`, by default 1, L/2 - 1 and L - 4); one layer
  `midlayer.*` whose attention reads [input_layernorm(embedding) ; hidden_norm(hidden)] (2H wide);
  `norm` and its own `lm_head` over a reduced draft vocabulary, `d2t` mapping a draft id to its
  target id (target = draft + d2t[draft]). Later steps feed the layer's own output back as `hidden`.

The layer's attention is its caller's (runtime/speculative/eagle_worker.py attends over a paged
pool; plait/train_eagle.py over a masked block): the head only projects `qkv` and finishes.
Inference multiplies through plait's linear layers (C kernels); training through `F.linear`.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.cpu_fused import rms_norm, silu_mul
from plait.runtime.layers.linear import (Linear, MergedColumnLinear, QKVLinear, RowLinear, UnquantizedMethod,
                                         VocabEmbedding, copy_loader)
from plait.runtime.model_config import ModelConfig

ARCHITECTURES = {"LlamaForCausalLMEagle": "EAGLE", "LlamaForCausalLMEagle3": "EAGLE3"}
KINDS = {v: k for k, v in ARCHITECTURES.items()}


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs an EAGLE-3 head reads when its config names none (SGLang's choice)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclass(frozen=True)
class EagleConfig:
    kind: str  # "EAGLE" or "EAGLE3"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int  # EAGLE-3's LM head rows (the target's vocabulary for EAGLE)
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: target layers whose outputs feed `fc`

    @property
    def feature_size(self) -> int:
        """Width of the target features the head takes."""
        return self.hidden_size * (len(self.aux_layer_ids) if self.kind == "EAGLE3" else 1)

    @classmethod
    def from_dict(cls, d: dict, target: ModelConfig) -> "EagleConfig":
        """From a head's config.json, checked against the target it drafts for."""
        archs = d.get("architectures") or []
        kinds = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if not kinds:
            raise ValueError(f"draft config: architectures {archs} names no EAGLE head (one of {sorted(ARCHITECTURES)})")
        kind = kinds[0]
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        aux: tuple[int, ...] = ()
        if kind == "EAGLE3":
            ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            aux = tuple(int(i) for i in ids) if ids else default_aux_layers(target.num_layers)
            if any(not 0 <= i < target.num_layers for i in aux):
                raise ValueError(f"draft config: eagle_aux_hidden_state_layer_ids {list(aux)} outside the target's "
                                 f"{target.num_layers} layers")
        cfg = cls(kind=kind, hidden_size=hidden, num_heads=heads,
                  num_kv_heads=int(d.get("num_key_value_heads") or heads),
                  head_dim=int(d.get("head_dim") or hidden // heads),
                  intermediate_size=int(d["intermediate_size"]), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                  rope_theta=float(d.get("rope_theta", target.rope_theta)), vocab_size=int(d["vocab_size"]),
                  draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]) if kind == "EAGLE3"
                  else int(d["vocab_size"]),
                  aux_layer_ids=aux)
        for field, mine, theirs in (("hidden_size", cfg.hidden_size, target.hidden_size),
                                    ("vocab_size", cfg.vocab_size, target.vocab_size)):
            if mine != theirs:
                raise ValueError(f"draft config: {field} {mine} does not match the target's {theirs}")
        if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
            raise ValueError(f"draft config: draft_vocab_size {cfg.draft_vocab_size} not in 1..{cfg.vocab_size}")
        return cfg

    def to_dict(self) -> dict:
        """config.json in the shape SGLang reads."""
        d = {"architectures": [KINDS[self.kind]], "model_type": "llama", "hidden_size": self.hidden_size,
             "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
             "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
             "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "vocab_size": self.vocab_size,
             "hidden_act": "silu", "tie_word_embeddings": False}
        if self.kind == "EAGLE3":
            d["draft_vocab_size"] = self.draft_vocab_size
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return d


def _norm_param(n: int) -> nn.Parameter:
    return nn.Parameter(torch.ones(n), requires_grad=False)


class EagleHead(nn.Module):
    """One EAGLE or EAGLE-3 head. `embed` and (EAGLE) `lm_head` are the target's layers unless the
    checkpoint brings its own embedding (`own_embed`)."""

    def __init__(self, cfg: EagleConfig, target_embed: VocabEmbedding, target_lm_head: VocabEmbedding,
                 own_embed: bool = False, fc_bias: bool | None = None):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.eagle3 = cfg.kind == "EAGLE3"
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        method = UnquantizedMethod(torch.float32)
        fc_in = cfg.feature_size if self.eagle3 else 2 * h
        self.fc = RowLinear(fc_in, h, (not self.eagle3) if fc_bias is None else fc_bias, method)
        attn_in = 2 * h if self.eagle3 else h
        self.qkv_proj = QKVLinear(attn_in, self.q_size, self.kv_size, False, method)
        self.o_proj = RowLinear(self.q_size, h, False, method)
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnLinear(h, {"gate": inter, "up": inter}, False, method)
        self.down_proj = RowLinear(inter, h, False, method)
        self.post_norm = _norm_param(h)
        if self.eagle3:
            self.input_norm, self.hidden_norm, self.norm = _norm_param(h), _norm_param(h), _norm_param(h)
            self.lm_head = VocabEmbedding(cfg.draft_vocab_size, h, method)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        else:
            self.lm_head = target_lm_head
        self.embed = VocabEmbedding(cfg.vocab_size, h, method) if own_embed else target_embed
        self.own_embed = own_embed
        self.training_mode = False  # multiply through F.linear (autograd) instead of the C kernels

    # ---- the parts of one step ------------------------------------------------------------
    def _mm(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, lin.weight, lin.bias) if self.training_mode else lin(x)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        return F.rms_norm(x, (x.shape[-1],), w, eps) if self.training_mode else rms_norm(x.contiguous(), w, eps)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed.embed(ids).float()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's k layer outputs -> the hidden the layer reads (a fed-back hidden passes)."""
        if self.eagle3 and features.shape[-1] != self.cfg.hidden_size:
            return self._mm(self.fc, features)
        return features

    def layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv of the layer's attention input [T, q + 2 kv], the residual stream [T, H])."""
        if self.eagle3:
            residual = hidden
            x = torch.cat([self._rms(embeds, self.input_norm), self._rms(hidden, self.hidden_norm)], dim=-1)
        else:
            residual = x = self._mm(self.fc, torch.cat([embeds, hidden], dim=-1))
        return self._mm(self.qkv_proj, x), residual

    def layer_output(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's output (the next step's hidden) from its attention output [T, q]."""
        x = residual + self._mm(self.o_proj, attn)
        gate_up = self._mm(self.gate_up_proj, self._rms(x, self.post_norm))
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up if self.training_mode else silu_mul(gate_up)
        return x + self._mm(self.down_proj, act)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, draft_vocab] (the target's vocabulary for EAGLE; `to_target` maps EAGLE-3's)."""
        if self.eagle3:
            return self._mm(self.lm_head, self._rms(hidden, self.norm)).float()
        return self._mm(self.lm_head, hidden).float()  # the target's (float weights when training)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.eagle3 else draft_ids

    # ---- loading ----------------------------------------------------------------------------
    def linears(self) -> list[Linear]:
        own = [self.fc, self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]
        return own + ([self.lm_head] if self.eagle3 else []) + ([self.embed] if self.own_embed else [])

    def weight_loaders(self) -> dict:
        """Checkpoint tensor name (SGLang's, without a `model.` prefix) -> loader."""
        p = "midlayer." if self.eagle3 else "layers.0."
        out = {"fc.weight": self.fc.weight_loader,
               p + "self_attn.o_proj.weight": self.o_proj.weight_loader,
               p + "mlp.down_proj.weight": self.down_proj.weight_loader,
               p + "post_attention_layernorm.weight": copy_loader(self.post_norm)}
        if self.fc.bias is not None:
            out["fc.bias"] = self.fc.bias_loader
        for x in "qkv":
            out[p + f"self_attn.{x}_proj.weight"] = functools.partial(self.qkv_proj.weight_loader, shard=x)
        for x in ("gate", "up"):
            out[p + f"mlp.{x}_proj.weight"] = functools.partial(self.gate_up_proj.weight_loader, shard=x)
        if self.eagle3:
            out.update({p + "input_layernorm.weight": copy_loader(self.input_norm),
                        p + "hidden_norm.weight": copy_loader(self.hidden_norm), "norm.weight": copy_loader(self.norm),
                        "lm_head.weight": self.lm_head.weight_loader, "d2t": self._load_d2t})
        if self.own_embed:
            out["embed_tokens.weight"] = self.embed.weight_loader
        return out

    def _load_d2t(self, t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(self.d2t.shape) or t.dtype.is_floating_point:
            raise ValueError(f"d2t of shape {tuple(t.shape)} ({t.dtype}) does not fit {tuple(self.d2t.shape)} integers")
        target = torch.arange(t.numel()) + t.long()
        if int(target.min()) < 0 or int(target.max()) >= self.cfg.vocab_size:
            raise ValueError(f"d2t maps draft ids outside the target's vocabulary of {self.cfg.vocab_size}")
        self.d2t.copy_(t.long())

    def finish_loading(self) -> None:
        for lin in self.linears():
            lin.finish_loading()

    def state_for_saving(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors (SGLang's names): weights in bfloat16, d2t as int64 (t2d as bool for EAGLE-3)."""
        p = "midlayer." if self.eagle3 else "layers.0."
        q, kv = self.q_size, self.kv_size
        w = self.qkv_proj.weight.detach()
        gate_up = self.gate_up_proj.weight.detach()
        inter = self.cfg.intermediate_size
        out = {"fc.weight": self.fc.weight, p + "self_attn.q_proj.weight": w[:q], p + "self_attn.k_proj.weight": w[q:q + kv],
               p + "self_attn.v_proj.weight": w[q + kv:], p + "self_attn.o_proj.weight": self.o_proj.weight,
               p + "mlp.gate_proj.weight": gate_up[:inter], p + "mlp.up_proj.weight": gate_up[inter:],
               p + "mlp.down_proj.weight": self.down_proj.weight, p + "post_attention_layernorm.weight": self.post_norm}
        if self.fc.bias is not None:
            out["fc.bias"] = self.fc.bias
        if self.eagle3:
            out.update({p + "input_layernorm.weight": self.input_norm, p + "hidden_norm.weight": self.hidden_norm,
                        "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight})
        tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}
        if self.eagle3:
            tensors["d2t"] = self.d2t.clone()
            t2d = torch.zeros(self.cfg.vocab_size, dtype=torch.bool)
            t2d[torch.arange(self.cfg.draft_vocab_size) + self.d2t] = True
            tensors["t2d"] = t2d
        return tensors


# tensors a head's checkpoint may carry that plait does not need
_IGNORED = ("t2d",)


def load_eagle_head(path: str, target: ModelConfig, target_model) -> EagleHead:
    """A head from a folder (config.json + *.safetensors), strictly: every tensor it needs once, none left
    over, each shape checked; errors name the tensor. `target_model`: anything with the target's `embed` and
    `lm_head` layers (whole, not split across ranks)."""
    from safetensors import safe_open

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"speculative draft model {path!r} has no config.json")
    with open(cfg_path) as f:
        cfg = EagleConfig.from_dict(json.load(f), target)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"speculative draft model {path!r} has no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                short = key.removeprefix("model.")
                if short in tensors:
                    raise ValueError(f"draft tensor {key} appears twice")
                tensors[short] = f.get_tensor(key)
    head = EagleHead(cfg, target_model.embed, target_model.lm_head, own_embed="embed_tokens.weight" in tensors,
                     fc_bias="fc.bias" in tensors)
    loaders = head.weight_loaders()
    missing = sorted(set(loaders) - set(tensors))
    leftover = sorted(set(tensors) - set(loaders) - set(_IGNORED))
    if missing or leftover:
        raise ValueError(f"draft weights do not match an {cfg.kind} head: missing {missing[:8]}, leftover {leftover[:8]}")
    for name, loader in loaders.items():
        t = tensors[name]
        try:
            loader(t if name == "d2t" else t.float())
        except ValueError as e:
            raise ValueError(f"draft tensor {name}: {e}") from None
    head.finish_loading()
    head.eval()
    return head


def save_eagle_head(head: EagleHead, out_dir: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(head.state_for_saving(), os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(head.cfg.to_dict(), f, indent=1)


def new_head(cfg: EagleConfig, target_model, seed: int = 0, std: float = 0.02,
             d2t: torch.Tensor | None = None) -> EagleHead:
    """A freshly initialised head (normal weights, unit norms) for training or tests; `d2t` for EAGLE-3
    (default: the first draft_vocab_size target ids)."""
    head = EagleHead(cfg, target_model.embed, target_model.lm_head)
    gen = torch.Generator().manual_seed(seed)
    for lin in head.linears():
        lin.weight.data.normal_(0.0, std, generator=gen)
        if lin.bias is not None:
            lin.bias.data.zero_()
    if head.eagle3:
        head.d2t.copy_(d2t if d2t is not None else torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
    head.finish_loading()
    return head.eval()
