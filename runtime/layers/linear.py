"""Linear layers that own their weights: the layout, the loader that knows each checkpoint tensor's
slice, and the method that multiplies (plain, packed or block-quantized: runtime/layers/quantization.py).

A layer's output rows are split into named shards (q/k/v, gate/up), each filled from one
checkpoint tensor by `weight_loader(tensor, shard)`; the strict loader calls it with whatever the
source holds (a float tensor, or GGUF blocks as `BlockTensor`) and the method converts what it
must. After loading, `finish_loading()` builds the method's matmul copies.

Tensor parallelism (runtime/distributed/): a column-parallel layer keeps a range of each shard's
output rows (`keep_rows`: its heads, its slice of the intermediate size); a row-parallel layer
(o_proj, down_proj) keeps a range of input columns (`keep_cols`) and all-reduces its partial
product over the group; the vocabulary-parallel embedding keeps a range of token rows, reduces
its lookups and gathers its logits. Loaders take the whole checkpoint tensor and cut their part
(GGUF blocks are cut without dequantizing where the cut falls on block edges).

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
from plait.kernels.cpu_fused import act_mul, add_rms_norm, rms_norm
from plait.kernels.cpu_linear import MAX_ROWS, block_bf16, skinny_linear
from plait.kernels.cpu_quant import BlockTensor
from plait.runtime.distributed.group import SINGLE, Group, partition
from plait.runtime.forward.batch import current_batch


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
    return torch.bfloat16 if weight_dtype == torch.bfloat16 and cpu_isa.native_bf16() else torch.float32


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

    def apply_act_mul(self, layer: "Linear", gate_up: torch.Tensor, act: str, batch_invariant: bool) -> torch.Tensor:
        """apply(act(gate) * up) for gate_up = gate | up (act: silu, gelu_tanh); a method may fuse the activation
        into its matmul."""
        return self.apply(layer, act_mul(gate_up, act), batch_invariant)

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


def narrow(tensor: torch.Tensor | BlockTensor, dim: int, keep: range) -> torch.Tensor | BlockTensor:
    """Rows (dim 0) or columns (dim 1) `keep` of a checkpoint tensor; GGUF blocks stay blocks where the
    cut falls on block edges."""
    if not isinstance(tensor, BlockTensor):
        return tensor.narrow(dim, keep.start, len(keep))
    rows, cols = tensor.shape
    if dim == 0:
        return BlockTensor(tensor.blocks[keep.start : keep.stop], tensor.fmt, (len(keep), cols))
    size, bb = tensor.fmt.block_size, tensor.fmt.block_bytes
    if keep.start % size or len(keep) % size:
        return narrow(tensor.dequantize(), dim, keep)
    return BlockTensor(tensor.blocks[:, keep.start // size * bb : keep.stop // size * bb], tensor.fmt,
                       (rows, len(keep)))


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features] built from named row shards. `shards` gives each
    shard's rows in the checkpoint; under tensor parallelism `keep_rows[name]` is the range of them this
    rank holds, `keep_cols` the range of input columns (then `group` sums the partial products)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool, method: LinearMethod,
                 bias_dtype: torch.dtype = torch.float32, keep_rows: dict[str, range] | None = None,
                 keep_cols: range | None = None, group: Group = SINGLE):
        super().__init__()
        self.source_shape = (shards, in_features)
        self.keep_rows = keep_rows or {}
        self.keep_cols = keep_cols
        self.group = group
        self.in_features = len(keep_cols) if keep_cols is not None else in_features
        self.shard_rows: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            size = len(self.keep_rows[name]) if name in self.keep_rows else size
            self.shard_rows[name] = (offset, size)
            offset += size
        self.out_features = offset
        self.method = method
        method.create_weights(self)
        self.bias = empty_param(self.out_features, dtype=bias_dtype) if bias else None
        # LoRA adapters (runtime/lora/manager.py): slot -> its shards' (first output row, A [r, in],
        # (scaling * B)^T [r, rows])
        self.lora: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def _rows(self, shard: str, tensor_rows: int, what: str) -> int:
        if shard not in self.shard_rows:
            raise ValueError(f"{what}: no shard {shard!r} (has {list(self.shard_rows)})")
        start, size = self.shard_rows[shard]
        if tensor_rows != size:
            raise ValueError(f"{what}: {tensor_rows} rows, shard {shard!r} has {size}")
        return start

    def _local(self, tensor: torch.Tensor | BlockTensor, shard: str, what: str) -> torch.Tensor | BlockTensor:
        """This rank's part of a whole checkpoint tensor (shape-checked against the whole first)."""
        shards, in_features = self.source_shape
        if shard in self.keep_rows:
            if tensor.shape[0] != shards[shard]:
                raise ValueError(f"{what}: {tensor.shape[0]} rows, shard {shard!r} has {shards[shard]}")
            tensor = narrow(tensor, 0, self.keep_rows[shard])
        if self.keep_cols is not None and what == "weight":
            if len(tensor.shape) != 2 or tensor.shape[1] != in_features:
                raise ValueError(f"weight of shape {tuple(tensor.shape)} does not fit in_features {in_features}")
            tensor = narrow(tensor, 1, self.keep_cols)
        return tensor

    def weight_loader(self, tensor: torch.Tensor | BlockTensor, shard: str = "") -> None:
        tensor = self._local(tensor, shard, "weight")
        shape = tuple(tensor.shape)
        if len(shape) != 2 or shape[1] != self.in_features:
            raise ValueError(f"weight of shape {shape} does not fit in_features {self.in_features}")
        self.method.load_rows(self, self._rows(shard, shape[0], "weight"), tensor)

    def bias_loader(self, tensor: torch.Tensor, shard: str = "") -> None:
        if self.bias is None or tensor.dim() != 1:
            raise ValueError(f"bias of shape {tuple(tensor.shape)} for a layer {'with' if self.bias is not None else 'without'} bias")
        tensor = self._local(tensor, shard, "bias")
        start = self._rows(shard, tensor.shape[0], "bias")
        # a row-parallel layer's ranks each add their partial sums: the bias is added once, by rank 0
        keep = self.keep_cols is None or self.group.rank == 0
        self.bias.data[start : start + tensor.shape[0]].copy_(tensor if keep else torch.zeros_like(tensor))

    def finish_loading(self) -> None:
        self.method.finish_loading(self)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(y) if self.keep_cols is not None else y

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        y = self._reduce(self.method.apply(self, x, batch_invariant))
        segments = self._lora_segments()
        return y if segments is None else self._add_lora(x, y, segments)

    # with adapters in the batch, the fused paths run unfused: the adapters read the layer's input
    def forward_normed(self, x: torch.Tensor, norm_w: torch.Tensor, eps: float, batch_invariant: bool = False
                       ) -> torch.Tensor:
        """self(rms_norm(x, norm_w, eps))."""
        if self._lora_segments() is not None:
            return self.forward(rms_norm(x, norm_w, eps), batch_invariant)
        return self.method.apply_normed(self, x, norm_w, eps, batch_invariant)

    def forward_add_normed(self, x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                           batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, self(rms_norm(x + residual, norm_w, eps))): the residual stream and the next input."""
        if self._lora_segments() is not None:
            x, h = add_rms_norm(x, residual, norm_w, eps)
            return x, self.forward(h, batch_invariant)
        return self.method.apply_add_normed(self, x, residual, norm_w, eps, batch_invariant)

    def forward_act_mul(self, gate_up: torch.Tensor, batch_invariant: bool = False, act: str = "silu") -> torch.Tensor:
        """self(act(gate) * up), gate_up = gate | up."""
        if self._lora_segments() is not None:
            return self.forward(act_mul(gate_up, act), batch_invariant)
        return self._reduce(self.method.apply_act_mul(self, gate_up, act, batch_invariant))

    def _lora_segments(self) -> list[tuple[int, int, int]] | None:
        """The active batch's adapter segments (start, stop, slot) when this layer has adapters, else None."""
        if not self.lora:
            return None
        return current_batch().lora or None

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
        """y += B (A x) per segment of rows, each with its own adapter (a segmented low-rank matmul): on a GPU one
        Triton launch for all the segments (kernels/triton_lora.py), on a CPU a product per segment."""
        if x.is_cuda:
            from plait.kernels.triton_lora import lora_triton, stack_pairs

            used = [(start, stop, slot) for start, stop, slot in segments if slot in self.lora]
            slots = sorted({slot for _, _, slot in used})
            if slots:
                a, bt = stack_pairs([self._whole_pair(self.lora[slot]) for slot in slots])
                lora_triton(x.float().contiguous(), y, a, bt, [(s, e, slots.index(slot)) for s, e, slot in used])
            return y
        for start, stop, slot in segments:
            for off, a, bt in self.lora.get(slot, ()):
                y[start:stop, off : off + bt.shape[1]] += (x[start:stop].float() @ a.T) @ bt
        return y

    def _whole_pair(self, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's shards as one pair over the whole output: A stacked, B^T laid into its shards' columns."""
        a = torch.cat([p[1] for p in parts])
        bt = a.new_zeros(a.shape[0], self.out_features)
        row = 0
        for off, ai, bti in parts:
            bt[row : row + ai.shape[0], off : off + bti.shape[1]] = bti
            row += ai.shape[0]
        return a, bt


class QKVLinear(Linear):
    """Q, K and V projections as one matmul (column-parallel: a rank keeps its heads' rows of each)."""

    def __init__(self, hidden: int, q_size: int, kv_size: int, bias: bool, method: LinearMethod,
                 q_keep: range | None = None, kv_keep: range | None = None):
        keep = None if q_keep is None else {"q": q_keep, "k": kv_keep, "v": kv_keep}
        super().__init__(hidden, {"q": q_size, "k": kv_size, "v": kv_size}, bias, method, keep_rows=keep)


class MergedColumnLinear(Linear):
    """Several projections of the same input as one matmul (gate and up)."""


class RowLinear(Linear):
    """A projection back to the hidden size (o_proj, down_proj): tensor parallelism splits its input."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod,
                 keep_cols: range | None = None, group: Group = SINGLE):
        super().__init__(in_features, {"": out_features}, bias, method, keep_cols=keep_cols, group=group)


class VocabEmbedding(Linear):
    """The token embedding [vocab, hidden]: looked up by rows, and, when tied, the LM head's matmul.
    Vocabulary-parallel: a rank holds a range of token rows; lookups of others' tokens give zeros and
    the group sums them; logits are gathered."""

    def __init__(self, vocab: int, hidden: int, method: LinearMethod, group: Group = SINGLE):
        self.parts = [partition(vocab, group.size, r) for r in range(group.size)]
        keep = {"": self.parts[group.rank]} if group.distributed else None
        super().__init__(hidden, {"": vocab}, False, method, keep_rows=keep, group=group)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.group.distributed:
            return self.method.rows(self, ids)
        mine = self.parts[self.group.rank]
        local = ids - mine.start
        hit = (local >= 0) & (local < len(mine))
        rows = self.method.rows(self, torch.where(hit, local, 0))
        return self.group.all_reduce(rows * hit.unsqueeze(-1))

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        logits = self.method.apply(self, x, batch_invariant)
        if not self.group.distributed:
            return logits
        sizes = [len(p) for p in self.parts]
        return self.group.all_gather(logits.float().T.contiguous(), sizes).T
