"""One parametrised decoder for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2
and 3, and the mixture-of-experts variants Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Differences are config switches (runtime/model_config.py: qkv bias, q/k norm per head or over all heads, q/k/v
clipping, tied embeddings, rope scaling, which layers' MLP is sparse (runtime/layers/moe.py), Gemma's GeGLU,
norms around both sublayers, embedding scale and soft caps, sliding-window layers with their own rotary base,
Phi-3's fused checkpoint projections).
Q/K/V and gate/up projections are fused into single matrices: fewer, larger matmuls.
Positions and KV slots come from the active ForwardBatch, not from arguments.

Under tensor parallelism (a `Group` of ranks) each rank holds a contiguous range of KV heads with the
query heads that read them, a slice of the MLP's intermediate rows, and a slice of the vocabulary
(runtime/layers/linear.py); o_proj and down_proj all-reduce.

Layers own their weights and loaders (runtime/layers/linear.py); how each matmul weight is stored
(the model's dtype, or quantized blocks) is its layer's method, chosen by the QuantConfig. Norms,
biases, activations and all arithmetic are in `compute_dtype` (float32 on CPU: the kernels widen
16-bit and quantized weights on load).
"""

from __future__ import annotations

import functools
import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels import cpu_decode
from plait.kernels.cpu_decode import DecodeLayers
from plait.kernels.cpu_fused import add_rms_norm, head_rms_norm_, rms_norm, rope_store
from plait.kernels.cpu_quant import GROUP, BlockTensor
from plait.radix_cache.memory_pool import KVPool
from plait.runtime.distributed.group import SINGLE, Group, partition
from plait.runtime.layers.attention import paged_attention
from plait.runtime.layers.linear import (MergedColumnLinear, QKVLinear, RowLinear, VocabEmbedding, WeightLoader,
                                         copy_loader, empty_param, narrow)
from plait.runtime.layers.moe import SparseMLP
from plait.runtime.layers.quantization import BlockQuantizedMethod, QuantConfig
from plait.runtime.layers.rotary import RotaryEmbedding
from plait.runtime.model_config import FULL, SLIDING, ModelConfig
from plait.runtime.forward.batch import FINAL_HIDDEN, current_batch
from plait.runtime.forward.graph import GraphRunner



def local_heads(cfg: ModelConfig, group: Group) -> tuple[range, range]:
    """The query heads and KV heads this rank holds: a contiguous range of KV heads (as even as the count
    allows: 3 over 2 ranks is 2 and 1) with the query heads of their groups."""
    if group.size > cfg.num_kv_heads:
        raise ValueError(f"tp_size {group.size} is more than the model's {cfg.num_kv_heads} KV heads")
    kv = partition(cfg.num_kv_heads, group.size, group.rank)
    per_kv = cfg.num_heads // cfg.num_kv_heads
    return range(kv.start * per_kv, kv.stop * per_kv), kv


def _rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def _norm_loader(param: nn.Parameter, offset: float) -> WeightLoader:
    """copy_loader of a norm weight stored as scale - offset (Gemma stores weight - 1)."""
    load = copy_loader(param)
    return load if not offset else (lambda tensor: load(tensor.float() + offset))


def _split_loader(loader, sizes: dict[str, int]) -> WeightLoader:
    """The loader of a checkpoint tensor that stacks several shards' rows (Phi-3's qkv_proj, gate_up_proj): each
    part goes to `loader(part, shard=name)`."""
    def load(tensor: torch.Tensor | BlockTensor) -> None:
        if tensor.shape[0] != sum(sizes.values()):
            raise ValueError(f"{tensor.shape[0]} rows, the fused shards {sizes} have {sum(sizes.values())}")
        start = 0
        for name, size in sizes.items():
            loader(narrow(tensor, 0, range(start, start + size)), shard=name)
            start += size
    return load


def _sliced_loader(param: nn.Parameter, keep: range | None, full: int, offset: float = 0.0) -> WeightLoader:
    """_norm_loader of `keep`'s part of a checkpoint vector of `full` values (all of it when keep is None)."""
    load = _norm_loader(param, offset)
    if keep is None:
        return load

    def load_part(tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != (full,):
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit ({full},)")
        load(tensor[keep.start : keep.stop])
    return load_part


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, quant: QuantConfig, compute_dtype: torch.dtype,
                 group: Group = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        self.group = group
        h, d = cfg.hidden_size, cfg.head_dim
        q_heads, kv_heads = local_heads(cfg, group)
        self.q_full = cfg.num_heads * d
        self.q_size, self.kv_size = len(q_heads) * d, len(kv_heads) * d
        self.num_heads, self.num_kv_heads, self.head_dim = len(q_heads), len(kv_heads), d
        self.kv_full = cfg.num_kv_heads * d
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.attn_scale or d**-0.5
        self.cfg = cfg
        self.layer_type = cfg.layer_type(layer_id)
        self.window = cfg.sliding_window if self.layer_type == SLIDING else 0
        self.softcap = cfg.attn_softcap or 0.0
        p = f"model.layers.{layer_id}."
        attn, mlp = p + "self_attn.", p + "mlp."
        split = group.distributed
        # the checkpoint rows this rank keeps (None: all of them)
        q_rows, kv_rows = (_rows(q_heads, d), _rows(kv_heads, d)) if split else (None, None)
        self.input_norm = empty_param(h, dtype=compute_dtype)
        self.qkv_proj = QKVLinear(h, self.q_full, self.kv_full, cfg.qkv_bias,
                                  quant.method([attn + f"{x}_proj.weight" for x in "qkv"]), q_rows, kv_rows)
        self.qk_norm, self.clip_qkv = cfg.qk_norm, cfg.clip_qkv
        full = cfg.qk_norm == "full"
        # a norm over all heads is split like the heads (its sum of squares is reduced across ranks)
        self.q_keep, self.kv_keep = (q_rows, kv_rows) if full else (None, None)
        self.q_norm = empty_param(self.q_size if full else d, dtype=compute_dtype) if cfg.qk_norm else None
        self.k_norm = empty_param(self.kv_size if full else d, dtype=compute_dtype) if cfg.qk_norm else None
        self.o_proj = RowLinear(self.q_full, h, False, quant.method([attn + "o_proj.weight"]), q_rows, group)
        self.post_norm = empty_param(h, dtype=compute_dtype)  # the MLP's input norm
        # Gemma: the attention's and the MLP's outputs are normed too, before they join the residual stream
        self.attn_out_norm = empty_param(h, dtype=compute_dtype) if cfg.sandwich_norms else None
        self.mlp_out_norm = empty_param(h, dtype=compute_dtype) if cfg.sandwich_norms else None
        self.gate_up_proj = self.down_proj = self.sparse = None
        if cfg.moe is not None and layer_id in cfg.moe.sparse_layers:
            shared = [mlp + f"shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")]
            methods = {"gate_up": shared[:2], "down": shared[2:]}
            self.sparse = SparseMLP(cfg.moe, h, quant.dtype, lambda part: quant.method(methods[part]), group)
        else:
            inter = cfg.intermediate_size
            # in whole quantization blocks: they are down_proj's input columns
            keep = partition(inter, group.size, group.rank, GROUP) if split else None
            self.gate_up_proj = MergedColumnLinear(h, {"gate": inter, "up": inter}, False,
                                                   quant.method([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
                                                   keep_rows={"gate": keep, "up": keep} if split else None)
            self.down_proj = RowLinear(inter, h, False, quant.method([mlp + "down_proj.weight"]), keep, group)

    def linears(self) -> list[nn.Module]:
        mlp = self.sparse.linears() if self.sparse is not None else [self.gate_up_proj, self.down_proj]
        return [self.qkv_proj, self.o_proj, *mlp]

    def weight_loaders(self) -> dict[str, WeightLoader]:
        p, cfg, off = f"model.layers.{self.layer_id}.", self.cfg, self.cfg.norm_offset
        out: dict[str, WeightLoader] = {
            p + "input_layernorm.weight": _norm_loader(self.input_norm, off),
            p + "self_attn.o_proj.weight": self.o_proj.weight_loader,
        }
        if cfg.sandwich_norms:
            out[p + "post_attention_layernorm.weight"] = _norm_loader(self.attn_out_norm, off)
            out[p + "pre_feedforward_layernorm.weight"] = _norm_loader(self.post_norm, off)
            out[p + "post_feedforward_layernorm.weight"] = _norm_loader(self.mlp_out_norm, off)
        else:
            out[p + "post_attention_layernorm.weight"] = _norm_loader(self.post_norm, off)
        if cfg.fused_qkv:
            sizes = {"q": self.q_full, "k": self.kv_full, "v": self.kv_full}
            out[p + "self_attn.qkv_proj.weight"] = _split_loader(self.qkv_proj.weight_loader, sizes)
        else:
            for x in "qkv":
                out[p + f"self_attn.{x}_proj.weight"] = functools.partial(self.qkv_proj.weight_loader, shard=x)
        for x in "qkv" if self.qkv_proj.bias is not None else "":
            out[p + f"self_attn.{x}_proj.bias"] = functools.partial(self.qkv_proj.bias_loader, shard=x)
        if self.sparse is not None:
            out.update(self.sparse.weight_loaders(p))
        else:
            out[p + "mlp.down_proj.weight"] = self.down_proj.weight_loader
            if cfg.fused_gate_up:
                inter = {"gate": cfg.intermediate_size, "up": cfg.intermediate_size}
                out[p + "mlp.gate_up_proj.weight"] = _split_loader(self.gate_up_proj.weight_loader, inter)
            else:
                for x in ("gate", "up"):
                    out[p + f"mlp.{x}_proj.weight"] = functools.partial(self.gate_up_proj.weight_loader, shard=x)
        if self.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = _sliced_loader(self.q_norm, self.q_keep, self.q_full, off)
            out[p + "self_attn.k_norm.weight"] = _sliced_loader(self.k_norm, self.kv_keep, self.kv_full, off)
        return out

    def _split_rms_norm(self, x: torch.Tensor, w: torch.Tensor, width: int) -> torch.Tensor:
        """RMS norm over a row of `width` values of which this rank holds x's columns."""
        sq = self.group.all_reduce(x.float().pow(2).sum(-1, keepdim=True))
        return (x.float() * torch.rsqrt(sq / width + self.eps) * w).to(x.dtype)

    def forward(self, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]], pool: KVPool
                ) -> torch.Tensor:
        """One layer; `rope` holds the batch's (cos, sin) per layer type."""
        fb = current_batch()
        if self.window and fb.windowed is not None:  # this layer's K/V live in the window slots
            fb = fb.windowed
        cos, sin = rope.get(self.layer_type, rope[FULL])
        inv = fb.batch_invariant
        qkv = self.qkv_proj.forward_normed(x, self.input_norm, self.eps, inv)
        if self.q_norm is not None and self.qk_norm == "head":
            # per head (Qwen3, Gemma 3), before RoPE, in place in qkv (the C stack's kernel too: native_decode)
            head_rms_norm_(qkv, 0, self.num_heads, self.q_norm, self.eps)
            head_rms_norm_(qkv, self.q_size, self.num_kv_heads, self.k_norm, self.eps)
        elif self.q_norm is not None:  # over all heads at once (OLMoE), before RoPE, in place in qkv
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            if self.q_keep is not None:  # other ranks hold some of the heads
                q.copy_(self._split_rms_norm(q, self.q_norm, self.q_full))
                k.copy_(self._split_rms_norm(k, self.k_norm, self.kv_full))
            else:
                q.copy_(F.rms_norm(q, self.q_norm.shape, self.q_norm, self.eps))
                k.copy_(F.rms_norm(k, self.k_norm.shape, self.k_norm, self.eps))
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        # RoPE on q and k and the K/V store in one pass
        q = rope_store(qkv, cos, sin, self.num_heads, self.num_kv_heads, pool.k[self.layer_id],
                       pool.v[self.layer_id], fb.out_slots)
        attn = self.o_proj(paged_attention(fb, self.layer_id, pool, q, self.scale, self.window, self.softcap), inv)
        if self.attn_out_norm is not None:
            attn = rms_norm(attn, self.attn_out_norm, self.eps)
        if self.sparse is not None:
            x, h = add_rms_norm(x, attn, self.post_norm, self.eps)
            return x + self.sparse(h, inv)
        x, gate_up = self.gate_up_proj.forward_add_normed(x, attn, self.post_norm, self.eps, inv)
        mlp = self.down_proj.forward_act_mul(gate_up, inv, self.cfg.hidden_act)
        return x + (mlp if self.mlp_out_norm is None else rms_norm(mlp, self.mlp_out_norm, self.eps))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig, max_positions: int,
                 compute_dtype: torch.dtype = torch.float32, group: Group = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.group = group
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size,
                                    quant.method(["model.embed_tokens.weight"], embedding=True), group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, quant, compute_dtype, group) for i in range(cfg.num_layers))
        self.norm = empty_param(cfg.hidden_size, dtype=compute_dtype)
        self.lm_head = self.embed if cfg.tie_word_embeddings else VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, quant.method(["lm_head.weight"], embedding=True), group)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.rope_theta, max_positions, compute_dtype,
                                      spec=cfg.rope)
        # Gemma 3's sliding-window layers rotate with their own base
        self.rotary_local = None if cfg.rope_local is None else RotaryEmbedding(
            cfg.hf_config, cfg.head_dim, cfg.rope_local.theta, max_positions, compute_dtype, spec=cfg.rope_local)
        # set by the model runner (runtime/model_executor/graph_runner.py): the batches it takes skip the layer loop
        self.graph: GraphRunner | None = None

    def native_decode(self, pool: KVPool) -> DecodeLayers | None:
        """The layer stack as one C call for decode steps (kernels/cpu_decode.py), or None where a layer needs
        what the C stack does not do: tensor parallelism, experts, q/k norms over all heads, clipping, weights
        other than blocks of the C kernels (a float32 or bfloat16 weight goes through oneDNN or skinny_linear)."""
        if self.group.distributed or self.compute_dtype is not torch.float32:
            return None
        specs, max_rows = [], 1 << 30
        for layer in self.layers:
            if (layer.sparse is not None or layer.clip_qkv is not None
                    or (layer.q_norm is not None and layer.qk_norm != "head")):
                return None
            mats = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            projs = [_native_proj(m) for m in mats]
            if any(p is None for p in projs) or any(len(p.parts) > 1 or p.bias is not None for p in projs[1::2]):
                return None  # o_proj and down_proj are one weight each, with no bias of their own
            qkv, (o,), gate_up, (down,) = projs[0], projs[1].parts, projs[2], projs[3].parts
            # the stack runs the block kernel at every row count it takes, as the loop does only up to here
            max_rows = min([max_rows] + [BlockQuantizedMethod.kernel_rows(sub) for m in mats
                                         for sub in getattr(m, "sublayers", [m])])
            sliding = layer.layer_type == SLIDING
            specs.append(cpu_decode.LayerSpec(
                qkv, o, gate_up, down, layer.input_norm.data, layer.post_norm.data,
                None if layer.attn_out_norm is None else layer.attn_out_norm.data,
                None if layer.mlp_out_norm is None else layer.mlp_out_norm.data,
                pool.k[layer.layer_id], pool.v[layer.layer_id], layer.window, bool(layer.window),
                sliding and self.rotary_local is not None, layer.softcap,
                None if layer.q_norm is None else layer.q_norm.data,
                None if layer.k_norm is None else layer.k_norm.data))
        first = self.layers[0]
        return DecodeLayers(specs, self.cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                            first.eps, first.scale, self.cfg.hidden_act, max_rows)

    def rotary_of(self, layer: int) -> RotaryEmbedding:
        """The rotary embedding layer `layer`'s keys carry."""
        local = self.rotary_local is not None and self.cfg.layer_type(layer) == SLIDING
        return self.rotary_local if local else self.rotary

    def linears(self) -> list[nn.Module]:
        layers = [m for layer in self.layers for m in layer.linears()]
        return [self.embed, *layers] + ([] if self.lm_head is self.embed else [self.lm_head])

    def weight_formats(self) -> list[str]:
        """How the matmul weights are stored: "none" (in the model's dtype), "q8_0", "q4_1"."""
        return sorted({m.method.name for m in self.linears()})

    def finish_loading(self) -> None:
        """Build every layer's matmul copies (packed, interleaved) once the weights are in."""
        for m in self.linears():
            m.finish_loading()

    @torch.inference_mode()
    def forward(self, pool: KVPool, capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, features): logits (float32) at the active batch's `logits_rows`; with `capture` (layer ids;
        FINAL_HIDDEN for the last hidden state after the final norm), the features a draft head reads, at every
        token: [T, len(capture) * H], each layer's output (the residual stream after it) in `capture`'s order
        (else None)."""
        fb = current_batch()
        x = self.embed.embed(fb.input_ids).to(self.compute_dtype)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        rope = {FULL: self.rotary.tables(fb.positions)}
        if self.rotary_local is not None:
            rope[SLIDING] = self.rotary_local.tables(fb.positions)
        taken: dict[int, torch.Tensor] = {}
        if not capture and self.graph is not None and self.graph.takes(fb):
            x = self.graph.run(x, fb, rope)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, rope, pool)
                if i in capture:
                    taken[i] = x.clone()  # later layers add into x in place
        if FINAL_HIDDEN in capture:
            x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
            taken[FINAL_HIDDEN] = x
            logits = self.lm_head(x[fb.logits_rows], fb.batch_invariant).float()
        else:
            logits = self.lm_head(rms_norm(x[fb.logits_rows], self.norm, self.cfg.rms_norm_eps), fb.batch_invariant).float()
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits, torch.cat([taken[i].float() for i in capture], dim=-1) if capture else None

    def weight_loaders(self) -> dict[str, WeightLoader]:
        """HF tensor name -> the loader that puts it in place (the strict loader needs every one once)."""
        loaders: dict[str, WeightLoader] = {
            "model.embed_tokens.weight": self.embed.weight_loader,
            "model.norm.weight": _norm_loader(self.norm, self.cfg.norm_offset),
        }
        if self.lm_head is not self.embed:
            loaders["lm_head.weight"] = self.lm_head.weight_loader
        for layer in self.layers:
            loaders.update(layer.weight_loaders())
        return loaders


def _native_proj(layer: nn.Module) -> cpu_decode.Proj | None:
    """The layer's matmul as the C stack runs it: block weights whose C kernel is loaded (in one format, or in
    MixedMethod's parts), or None."""
    subs = getattr(layer, "sublayers", None)
    if subs is None:
        m = getattr(layer, "qmatmul", None)
        return cpu_decode.Proj((m,)) if m is not None and cpu_decode.fits(m) else None
    parts = tuple(getattr(sub, "qmatmul", None) for sub in subs)
    if len(parts) > 3 or not all(m is not None and cpu_decode.fits(m) and m.bias is None for m in parts):
        return None
    return cpu_decode.Proj(parts, None if layer.bias is None else layer.bias.data)
