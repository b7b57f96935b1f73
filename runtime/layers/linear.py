"""Linear layers that own their weights: the layout, the loader that knows each checkpoint tensor's
slice, and the method that multiplies (plain, packed or block-quantized: runtime/layers/quantization.py).

A layer's output rows are split into named shards (q/k/v, gate/up), each filled from one
checkpoint tensor by `weight_loader(tensor, shard)`; the strict loader calls it with whatever the
source holds (a float tensor, or GGUF blocks as `BlockTensor`) and the method converts what it
must. After loading, `finish_loading()` builds the method's matmul copies. Row-parallel layers
(o_proj, down_proj) are their own class because tensor parallelism will split their input instead.

The unquantized method on CPU: activations are float32; weights are float32, bfloat16 or float16.
Few-row matmuls (decode steps) go to a C kernel that streams the plain weight at near the read
bandwidth, widening 16-bit weights on load. Many-row matmuls (prefill, large decode batches) go to
oneDNN with a pre-packed ("reordered") copy of the weight: 10-40% faster here than `F.linear`
(MKL), most of all for the wide LM head. The packed copy is bfloat16 only where the CPU has native
bf16 dot products (AVX512-BF16); elsewhere it is float32, since oneDNN's emulated bf16 GEMM is
slower than its float32 one. With `batch_invariant` every row count goes to the C kernel, whose
per-row sums never depend on the batch (see kernels/skinny_linear.c). A bfloat16 weight also gets
the kernel's blocked layout (one sequential stream per 4 rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels import cpu_isa
from plait.kernels.cpu_fused import add_rms_norm, rms_norm, silu_mul
from plait.kernels.cpu_linear import MAX_ROWS, block_bf16, skinny_linear
from plait.kernels.cpu_quant import BlockTensor


WeightLoader = Callable[[torch.Tensor], None]


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def copy_loader(param: nn.Parameter) -> WeightLoader:
    """The loader of a parameter filled from one checkpoint tensor of exactly its shape (norms, routers)."""
    def load(tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(tensor)
    return load


@dataclass(frozen=True)
class PackedWeight:
    """Copies of one weight laid out for the matmul routes: oneDNN's blocked copy (many rows) and,
    for bfloat16, the C kernel's blocked layout (few rows). Either may be None."""

    onednn: torch.Tensor | None
    kernel: torch.Tensor | None


def packed_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of oneDNN's blocked copy of a weight stored in `weight_dtype`."""
    native_bf16 = cpu_isa.selected() == "avx512_bf16"
    return torch.bfloat16 if weight_dtype == torch.bfloat16 and native_bf16 else torch.float32


def onednn_copy(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """oneDNN's blocked copy of a CPU weight [out, in] in `dtype`, or None where oneDNN is missing."""
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.to(dtype).contiguous(), 1)


def onednn_linear(x: torch.Tensor, onednn: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ b) through a oneDNN-blocked weight, in x's dtype."""
    if onednn.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, onednn, b, "none", [], "")
    bias = None if b is None else b.to(onednn.dtype)
    return torch.ops.mkldnn._linear_pointwise(x.to(onednn.dtype), onednn, bias, "none", [], "").to(x.dtype)


def pack(w: torch.Tensor, dtype: torch.dtype | None = None) -> PackedWeight | None:
    """The packed copies of a CPU weight [out, in] (oneDNN's in `dtype`, default `packed_dtype(w.dtype)`),
    or None where none applies."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return PackedWeight(onednn_copy(w, dtype or packed_dtype(w.dtype)), block_bf16(w.contiguous()))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, packed: PackedWeight | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """`F.linear(x, w, b)` in x's dtype; `packed` is `pack(w)` or None."""
    onednn = packed.onednn if packed is not None else None
    if onednn is not None and x.dim() == 2 and x.shape[0] > MAX_ROWS and not batch_invariant:
        return onednn_linear(x, onednn, b)
    return skinny_linear(x, w, b, batch_invariant, packed.kernel if packed is not None else None)


class LinearMethod:
    """How a linear layer stores its weight and multiplies by it: the seam quantization plugs into."""

    name = "none"

    def create_weights(self, layer: "Linear") -> None:
        raise NotImplementedError

    def load_rows(self, layer: "Linear", row: int, tensor: torch.Tensor | BlockTensor) -> None:
        """Fill output rows [row, row + len(tensor)) from a checkpoint tensor (already shape-checked)."""
        raise NotImplementedError

    def finish_loading(self, layer: "Linear") -> None:
        """Build the matmul copies once every shard is loaded."""

    def apply(self, layer: "Linear", x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        raise NotImplementedError

    def apply_normed(self, layer: "Linear", x: torch.Tensor, norm_w: torch.Tensor, eps: float,
                     batch_invariant: bool) -> torch.Tensor:
        """apply(rms_norm(x, norm_w, eps)); a method may fuse the norm into its matmul."""
        return self.apply(layer, rms_norm(x, norm_w, eps), batch_invariant)

    def apply_add_normed(self, layer: "Linear", x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                         eps: float, batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, apply(rms_norm(x + residual, norm_w, eps))) as cpu_fused.add_rms_norm (which writes
        the sum into x); a method may fuse the two."""
        x, h = add_rms_norm(x, residual, norm_w, eps)
        return x, self.apply(layer, h, batch_invariant)

    def apply_silu_mul(self, layer: "Linear", gate_up: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """apply(silu(gate) * up) for gate_up = gate | up; a method may fuse the activation into its matmul."""
        return self.apply(layer, silu_mul(gate_up), batch_invariant)

    def rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as float32 (an embedding lookup)."""
        raise NotImplementedError


class UnquantizedMethod(LinearMethod):
    """A plain weight in the model's dtype, with the packed copies of `pack` unless `packed` is off."""

    def __init__(self, dtype: torch.dtype, packed: bool = True):
        self.dtype, self.packed = dtype, packed

    def create_weights(self, layer: "Linear") -> None:
        layer.weight = empty_param(layer.out_features, layer.in_features, dtype=self.dtype)
        layer.packed = None

    def load_rows(self, layer: "Linear", row: int, tensor: torch.Tensor | BlockTensor) -> None:
        if isinstance(tensor, BlockTensor):
            tensor = tensor.dequantize()
        layer.weight.data[row : row + tensor.shape[0]].copy_(tensor)

    def finish_loading(self, layer: "Linear") -> None:
        layer.packed = pack(layer.weight) if self.packed else None

    def apply(self, layer: "Linear", x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        return linear(x, layer.weight, layer.bias, layer.packed, batch_invariant)

    def rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight).float()


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features] built from named row shards."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool, method: LinearMethod,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features = in_features
        self.shard_rows: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_rows[name] = (offset, size)
            offset += size
        self.out_features = offset
        self.method = method
        method.create_weights(self)
        self.bias = empty_param(self.out_features, dtype=bias_dtype) if bias else None

    def _rows(self, shard: str, tensor_rows: int, what: str) -> int:
        if shard not in self.shard_rows:
            raise ValueError(f"{what}: no shard {shard!r} (has {list(self.shard_rows)})")
        start, size = self.shard_rows[shard]
        if tensor_rows != size:
            raise ValueError(f"{what}: {tensor_rows} rows, shard {shard!r} has {size}")
        return start

    def weight_loader(self, tensor: torch.Tensor | BlockTensor, shard: str = "") -> None:
        shape = tuple(tensor.shape)
        if len(shape) != 2 or shape[1] != self.in_features:
            raise ValueError(f"weight of shape {shape} does not fit in_features {self.in_features}")
        self.method.load_rows(self, self._rows(shard, shape[0], "weight"), tensor)

    def bias_loader(self, tensor: torch.Tensor, shard: str = "") -> None:
        if self.bias is None or tensor.dim() != 1:
            raise ValueError(f"bias of shape {tuple(tensor.shape)} for a layer {'with' if self.bias is not None else 'without'} bias")
        start = self._rows(shard, tensor.shape[0], "bias")
        self.bias.data[start : start + tensor.shape[0]].copy_(tensor)

    def finish_loading(self) -> None:
        self.method.finish_loading(self)

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        return self.method.apply(self, x, batch_invariant)

    def forward_normed(self, x: torch.Tensor, norm_w: torch.Tensor, eps: float, batch_invariant: bool = False
                       ) -> torch.Tensor:
        """self(rms_norm(x, norm_w, eps))."""
        return self.method.apply_normed(self, x, norm_w, eps, batch_invariant)

    def forward_add_normed(self, x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                           batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, self(rms_norm(x + residual, norm_w, eps))): the residual stream and the next input."""
        return self.method.apply_add_normed(self, x, residual, norm_w, eps, batch_invariant)

    def forward_silu_mul(self, gate_up: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """self(silu(gate) * up), gate_up = gate | up."""
        return self.method.apply_silu_mul(self, gate_up, batch_invariant)


class QKVLinear(Linear):
    """Q, K and V projections as one matmul (column-parallel: shards split by output rows)."""

    def __init__(self, hidden: int, q_size: int, kv_size: int, bias: bool, method: LinearMethod):
        super().__init__(hidden, {"q": q_size, "k": kv_size, "v": kv_size}, bias, method)


class MergedColumnLinear(Linear):
    """Several projections of the same input as one matmul (gate and up)."""


class RowLinear(Linear):
    """A projection back to the hidden size (o_proj, down_proj): tensor parallelism splits its input."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod):
        super().__init__(in_features, {"": out_features}, bias, method)


class VocabEmbedding(Linear):
    """The token embedding [vocab, hidden]: looked up by rows, and, when tied, the LM head's matmul."""

    def __init__(self, vocab: int, hidden: int, method: LinearMethod):
        super().__init__(hidden, {"": vocab}, False, method)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.rows(self, ids)
