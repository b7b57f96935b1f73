"""A decode step's stack of decoder layers as one C call (kernels/decode_layers.c).

The Python layer loop calls six kernels a layer (the matmuls with their fused norms and activation, RoPE and
the K/V store, paged attention) with a few microseconds of Python around each; at decode sizes that is about
as long as the kernels. `DecodeLayers` hands the same kernels the same inputs in the same order from C, so its
result is the loop's bit for bit. It covers dense layers whose matmul weights are blocks the C kernels read
(runtime/layers/quantization.py's BlockQuantizedMethod); the model builds it where every layer fits
(LlamaForCausalLM.native_decode), runtime/model_executor/graph_runner.py runs it for the decode steps it takes,
and the loop runs everything else.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from plait.kernels.cpu_build import FORMATS, PTR, load_library
from plait.kernels.cpu_quant import QuantMatmul

_I64, _F32 = ctypes.c_int64, ctypes.c_float


class _Mat(ctypes.Structure):
    _fields_ = [("w", PTR), ("bias", PTR), ("n", _I64), ("k", _I64), ("fmt", _I64), ("exact", _I64)]


class _Proj(ctypes.Structure):
    _fields_ = [("part", _Mat * 3), ("parts", _I64), ("bias", PTR)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Proj), ("gate_up", _Proj), ("o", _Mat), ("down", _Mat),
                ("input_norm", PTR), ("post_norm", PTR), ("attn_out_norm", PTR), ("mlp_out_norm", PTR),
                ("k_pool", PTR), ("v_pool", PTR), ("k_row", _I64), ("k_head", _I64), ("v_row", _I64),
                ("v_head", _I64), ("window", _I64), ("slot_set", _I64), ("rope_set", _I64), ("softcap", _F32),
                ("q_norm", PTR), ("k_norm", PTR)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("cos", PTR * 2), ("sin", PTR * 2), ("out_slots", PTR * 2), ("kv_slots", PTR * 2),
                ("kv_lens", PTR), ("max_len", _I64), ("kv_fmt", _I64), ("act", _I64), ("eps", _F32),
                ("scale", _F32), ("threads", _I64), ("invariant", _I64),
                ("lora", PTR), ("lora_row", PTR), ("lora_k", _I64), ("lora_rmax", _I64)]


class _LoraPair(ctypes.Structure):
    _fields_ = [("a", PTR), ("bt", PTR), ("r", _I64), ("off", _I64), ("n", _I64)]


LORA_PROJECTIONS = 4  # per layer, in the C table's order: qkv, o, gate_up, down
LORA_PARTS = 3  # shards per projection (q, k, v)


class LoraTable:
    """The pairs of the adapters `slots` (in that order) for every layer's four projections, as the C stack reads
    them: `pairs[layer][projection]` maps a slot to its shards' (output offset, A [r, k], (scaling * B)^T [r, n]),
    float32 contiguous, at most LORA_PARTS of them."""

    def __init__(self, slots: tuple[int, ...], pairs: list[list[dict[int, list]]]):
        entries, self._keep, rmax = [], [], 1
        for layer in pairs:
            if len(layer) != LORA_PROJECTIONS:
                raise ValueError(f"a layer has {len(layer)} projections' pairs, the stack takes {LORA_PROJECTIONS}")
            for by_slot in layer:
                for slot in slots:
                    parts = by_slot.get(slot, [])
                    if len(parts) > LORA_PARTS:
                        raise ValueError(f"{len(parts)} shards of one projection (at most {LORA_PARTS})")
                    for off, a, bt in parts:
                        if a.dtype is not torch.float32 or bt.dtype is not torch.float32 or not (
                                a.is_contiguous() and bt.is_contiguous()) or bt.shape[0] != a.shape[0]:
                            raise ValueError("LoRA pairs must be contiguous float32 A [r, k] and B^T [r, n]")
                        self._keep.append((a, bt))  # the table points into them
                        entries.append(_LoraPair(a.data_ptr(), bt.data_ptr(), a.shape[0], off, bt.shape[1]))
                        rmax = max(rmax, a.shape[0])
                    entries.extend(_LoraPair() for _ in range(LORA_PARTS - len(parts)))
        self.slots, self.rmax = slots, rmax
        self._table = (_LoraPair * len(entries))(*entries)

    def ptr(self) -> int:
        return ctypes.addressof(self._table)


@dataclass(frozen=True)
class Proj:
    """A projection: one weight's matmul, or up to three side by side (their formats differ) with `bias` added
    over all of them after (MixedMethod)."""

    parts: tuple[QuantMatmul, ...]
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as the C stack reads it. Norm weights are float32 [hidden]; the pools [Hkv, S, D]."""

    qkv: Proj
    o: QuantMatmul
    gate_up: Proj
    down: QuantMatmul
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    window: int  # > 0: sliding-window layer
    windowed: bool  # its K/V live in the window slots (ForwardBatch.windowed)
    local_rope: bool  # rotates by the local rotary table
    softcap: float
    q_norm: torch.Tensor | None = None  # per-head norms of q and k [head_dim] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class StepTables:
    """A decode batch's tables, per slot set (0: every token's slots; 1: the window slots, or None) and per
    rotary table (0: full; 1: local, or None)."""

    cos: tuple[torch.Tensor, torch.Tensor | None]
    sin: tuple[torch.Tensor, torch.Tensor | None]
    out_slots: tuple[torch.Tensor, torch.Tensor | None]
    kv_slots: tuple[torch.Tensor, torch.Tensor | None]
    kv_lens: torch.Tensor


def _mat(m: QuantMatmul) -> _Mat:
    return _Mat(m._w, m._b, m.n, m.k, m.fmt.code, int(m.exact))


def _proj(p: Proj) -> _Proj:
    if not 1 <= len(p.parts) <= 3:
        raise ValueError(f"a projection of {len(p.parts)} parts (1 to 3)")
    if p.bias is not None and (p.bias.dtype is not torch.float32 or not p.bias.is_contiguous()):
        raise ValueError("a projection's bias must be contiguous float32")
    parts = [_mat(m) for m in p.parts] + [_Mat()] * (3 - len(p.parts))
    return _Proj((_Mat * 3)(*parts), len(p.parts), _ptr(p.bias))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def fits(m: QuantMatmul) -> bool:
    """Whether the C stack can run this matmul (its C kernel is loaded for it)."""
    return m._fn is not None and _library() is not None


class DecodeLayers:
    """The stack of `layers` for decode batches: call with the residual stream x [rows, hidden] (float32,
    updated in place) and the batch's StepTables."""

    def __init__(self, layers: list[LayerSpec], hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 scale: float, act: str, max_rows: int):
        self._lib = _library()
        kv = layers[0].k_pool
        if kv.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"KV pool dtype {kv.dtype}: the stack stores float32 or bfloat16")
        self.layers = layers  # kept alive: the C table points into their tensors
        self._table = (_Layer * len(layers))(*[self._layer(s) for s in layers])
        self._step = _Step(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, kv_fmt=FORMATS[kv.dtype],
                           act=0 if act == "silu" else 1, eps=eps, scale=scale)
        self.hidden = hidden
        self.max_rows = max_rows  # batches of more rows run the loop, whose matmuls go to a GEMM there

    @staticmethod
    def _layer(s: LayerSpec) -> _Layer:
        for t in (s.input_norm, s.post_norm, s.attn_out_norm, s.mlp_out_norm, s.q_norm, s.k_norm):
            if t is not None and (t.dtype is not torch.float32 or not t.is_contiguous()):
                raise ValueError("norm weights must be contiguous float32")
        if s.k_pool.stride(-1) != 1 or s.v_pool.stride(-1) != 1:
            raise ValueError("KV pools must have contiguous head rows")
        return _Layer(_proj(s.qkv), _proj(s.gate_up), _mat(s.o), _mat(s.down), s.input_norm.data_ptr(),
                      s.post_norm.data_ptr(), _ptr(s.attn_out_norm), _ptr(s.mlp_out_norm), s.k_pool.data_ptr(),
                      s.v_pool.data_ptr(), s.k_pool.stride(1), s.k_pool.stride(0), s.v_pool.stride(1),
                      s.v_pool.stride(0), s.window, int(s.windowed), int(s.local_rope), s.softcap, _ptr(s.q_norm),
                      _ptr(s.k_norm))

    def __call__(self, x: torch.Tensor, t: StepTables, invariant: bool,
                 lora: tuple[LoraTable, torch.Tensor] | None = None) -> torch.Tensor:
        """`lora`: the step's adapters' table and each row's index into its slots (int64, -1: none)."""
        if x.dtype is not torch.float32 or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be contiguous float32 [rows, {self.hidden}], got {tuple(x.shape)} {x.dtype}")
        step = self._step
        if lora is None:
            step.lora = step.lora_row = None
        else:
            table, rows = lora
            if rows.dtype is not torch.int64 or rows.shape != (x.shape[0],) or not rows.is_contiguous():
                raise ValueError("the LoRA rows must be contiguous int64, one per row")
            if int(rows.max()) >= len(table.slots) or len(table._table) != (
                    len(self.layers) * LORA_PROJECTIONS * len(table.slots) * LORA_PARTS):
                raise ValueError("the LoRA table does not fit the rows or the layers")
            step.lora, step.lora_row = table.ptr(), rows.data_ptr()
            step.lora_k, step.lora_rmax = len(table.slots), table.rmax
        step.rows, step.max_len = x.shape[0], t.kv_slots[0].shape[1]
        for i in range(2):
            # an absent set or table is never read: no layer names it
            step.cos[i], step.sin[i] = _ptr(t.cos[i]), _ptr(t.sin[i])
            step.out_slots[i], step.kv_slots[i] = _ptr(t.out_slots[i]), _ptr(t.kv_slots[i])
        step.kv_lens = t.kv_lens.data_ptr()
        step.threads, step.invariant = torch.get_num_threads(), int(invariant)
        if self._lib.decode_layers(self._table, len(self.layers), ctypes.byref(step), x.data_ptr()):
            raise MemoryError("decode_layers: no scratch memory")
        return x


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_library("decode_layers", decode_layers=(PTR, ctypes.c_int64, PTR, PTR))
    if lib is not None:
        lib.decode_layers.restype = ctypes.c_int
    return lib
