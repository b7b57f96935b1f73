"""Weight-only block quantization (`--quantization`): which method each layer gets, and the method.

  none  every weight in the model's dtype (runtime/layers/linear.py's UnquantizedMethod)
  int8  every matmul weight as Q8_0 blocks (32 int8 values and one scale)
  int4  transformer layers as Q4_1 blocks (32 4-bit values, a scale and a minimum); the embedding
        and LM head as Q8_0, since the logits are the most sensitive to weight error (llama.cpp's rule)
  auto  a GGUF file's own blocks as stored, per tensor (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K: its
        precision, with no float round trip; a layer whose shards differ keeps each in its own); other
        tensors, and float checkpoints, as `none`

Blocks are llama.cpp's layouts (kernels/cpu_quant.py), so GGUF blocks load straight into the
kernel's layout; float tensors are quantized when they load; blocks of another format are
dequantized and requantized. The kernel quantizes each input row per block, to int8 (--quantized-matmul int8, and
int8-k, the default on AVX2, for the K formats: kernels/q8_linear.h, integer dot products at twice the exact path's
rate, every row count, no copy of the weight) or to int16 (exact, the default on the AVX-512 levels, and int8-k's
path for Q8_0/Q4_1/Q5_0: kernels/quant_linear.c). On the
exact path, from 8 rows, on a CPU with AVX512-BF16 and where batch invariance is not asked for, the kernel decodes the
weight to bfloat16 16 rows at a time for all the input rows (kernels/bf16_panel.h): as fast as oneDNN's bfloat16 GEMM
over a float copy, so a model holds its weights once, at its file's size. On other CPUs the exact path's many-row
matmuls (prefill, batches of more than MAX_ROWS rows) over Q8_0/Q4_1/Q5_0 blocks go to oneDNN with a float32 copy
dequantized once at load, unless --disable-packed-weights; the K formats (Q4_K, Q5_K, Q6_K) stay with the kernel,
which decodes each weight tile once for all the rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plait.kernels.cpu_linear import MAX_ROWS
from plait.kernels.cpu_quant import (Q4_1, Q8_0, BlockFormat, BlockTensor, QuantMatmul, bf16_panels, deinterleave,
                                     dequantize, interleave_, quant_rows, quantize)
from plait.runtime.layers.linear import Linear, LinearMethod, UnquantizedMethod, empty_param, onednn_copy, \
    onednn_linear

QUANTIZATIONS = ("none", "auto", "int8", "int4")


class MixedMethod(LinearMethod):
    """A layer whose shards are stored in different formats (a Q4_K_M file's Q4_K q and k beside a Q6_K v): one
    sub-layer per run of shards that share a method, each kept at its own precision, their outputs side by
    side. The norm or activation before the matmul is then computed once for all of them."""

    def __init__(self, methods: list[LinearMethod]):
        self.methods = methods  # one per shard, in the layer's shard order
        self.name = "+".join(dict.fromkeys(m.name for m in methods))

    def create_weights(self, layer: Linear) -> None:
        runs: list[tuple[LinearMethod, dict[str, int]]] = []
        for (shard, (_, size)), method in zip(layer.shard_rows.items(), self.methods):
            if runs and runs[-1][0] is method:
                runs[-1][1][shard] = size
            else:
                runs.append((method, {shard: size}))
        layer.sublayers = torch.nn.ModuleList(Linear(layer.in_features, shards, False, method)
                                              for method, shards in runs)
        layer.sub_starts = []
        start = 0
        for sub in layer.sublayers:
            layer.sub_starts.append(start)
            start += sub.out_features

    def load_rows(self, layer: Linear, row: int, tensor: torch.Tensor | BlockTensor) -> None:
        i = max(k for k, s in enumerate(layer.sub_starts) if s <= row)
        sub = layer.sublayers[i]
        sub.method.load_rows(sub, row - layer.sub_starts[i], tensor)

    def finish_loading(self, layer: Linear) -> None:
        for sub in layer.sublayers:
            sub.finish_loading()

    def apply(self, layer: Linear, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        y = torch.cat([sub.method.apply(sub, x, batch_invariant) for sub in layer.sublayers], dim=-1)
        return y if layer.bias is None else y + layer.bias

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("an embedding is one tensor, in one format")


class BlockQuantizedMethod(LinearMethod):
    """The weight as blocks of `fmt` in the kernel's layout (with a oneDNN float32 copy for many rows on a CPU without
    bfloat16 dot products)."""

    def __init__(self, fmt: BlockFormat, packed: bool = True, exact: bool = True):
        self.fmt, self.packed, self.exact = fmt, packed, exact
        self.name = fmt.name

    def create_weights(self, layer: Linear) -> None:
        if layer.in_features % self.fmt.block_size:
            raise ValueError(f"{self.fmt.name} needs in_features divisible by {self.fmt.block_size}, got "
                             f"{layer.in_features}")
        # plain blocks while loading; interleaved into the kernel's layout by finish_loading
        layer.qweight = empty_param(layer.out_features, self.fmt.row_bytes(layer.in_features), dtype=torch.uint8)
        layer.onednn = layer.qmatmul = None

    def load_rows(self, layer: Linear, row: int, tensor: torch.Tensor | BlockTensor) -> None:
        if isinstance(tensor, BlockTensor) and tensor.fmt is self.fmt:
            blocks = tensor.blocks
        else:
            blocks = quantize(tensor.dequantize() if isinstance(tensor, BlockTensor) else tensor, self.fmt)
        layer.qweight.data[row : row + blocks.shape[0]].copy_(blocks)

    def finish_loading(self, layer: Linear) -> None:
        interleave_(layer.qweight.data, self.fmt)
        layer.qmatmul = QuantMatmul(layer.qweight.data, self.fmt, layer.bias, self.exact)
        # a float32 copy for oneDNN only where the kernel's many-row path is not as fast: the exact path (int16
        # activations) without bfloat16 dot products; int8 activations multiply many rows faster than that copy
        if self.packed and self.exact and not self.fmt.super_block and not bf16_panels():
            layer.onednn = onednn_copy(dequantize(deinterleave(layer.qweight.data, self.fmt), self.fmt), torch.float32)

    def apply(self, layer: Linear, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        if self._onednn(layer, x, batch_invariant):
            return onednn_linear(x, layer.onednn, layer.bias)
        return layer.qmatmul(x, batch_invariant)

    def apply_normed(self, layer: Linear, x: torch.Tensor, norm_w: torch.Tensor, eps: float,
                     batch_invariant: bool) -> torch.Tensor:
        if self._onednn(layer, x, batch_invariant):
            return super().apply_normed(layer, x, norm_w, eps, batch_invariant)
        return layer.qmatmul.normed(x, norm_w, eps, batch_invariant)

    def apply_add_normed(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                         eps: float, batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self._onednn(layer, x, batch_invariant):
            return super().apply_add_normed(layer, x, residual, norm_w, eps, batch_invariant)
        return layer.qmatmul.add_normed(x, residual, norm_w, eps, batch_invariant)

    def apply_act_mul(self, layer: Linear, gate_up: torch.Tensor, act: str, batch_invariant: bool) -> torch.Tensor:
        if self._onednn(layer, gate_up, batch_invariant):
            return super().apply_act_mul(layer, gate_up, act, batch_invariant)
        return layer.qmatmul.act_mul(gate_up, act, batch_invariant)

    @staticmethod
    def kernel_rows(layer: Linear) -> int:
        """The most rows a call that need not be batch-invariant gives the block kernel (more go to oneDNN)."""
        return MAX_ROWS if layer.onednn is not None else 1 << 30

    @classmethod
    def _onednn(cls, layer: Linear, x: torch.Tensor, batch_invariant: bool) -> bool:
        return not batch_invariant and x.dim() == 2 and x.shape[0] > cls.kernel_rows(layer)

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        return quant_rows(layer.qweight, self.fmt, ids)


def int8_activations(matmul: str, fmt: BlockFormat) -> bool:
    """Whether a weight in `fmt` multiplies int8 activations under --quantized-matmul `matmul` (int8-k: the K formats
    alone, whose input blocks have two levels of scale)."""
    if matmul not in ("exact", "int8", "int8-k"):
        raise ValueError(f"quantized_matmul must be exact, int8 or int8-k once resolved, got {matmul!r}")
    return matmul == "int8" or (matmul == "int8-k" and fmt.super_block)


@dataclass(frozen=True)
class QuantConfig:
    """The method each layer gets: `mode` from --quantization; for `auto`, `file_formats` maps
    checkpoint tensor names to the block format they are stored in (GGUF), None where float."""

    mode: str
    dtype: torch.dtype
    packed: bool = True
    file_formats: dict[str, BlockFormat | None] = field(default_factory=dict)
    matmul: str = "exact"  # --quantized-matmul, resolved: exact, int8 or int8-k

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {self.mode!r}")

    def method(self, tensor_names: list[str], embedding: bool = False) -> LinearMethod:
        """The method of the layer filled from these checkpoint tensors (one per shard, in order): under auto,
        shards stored in different formats keep theirs (MixedMethod)."""
        formats = [self._format(n, embedding) for n in tensor_names]
        methods = {fmt: self._method(fmt) for fmt in dict.fromkeys(formats)}
        if len(methods) == 1:
            return next(iter(methods.values()))
        return MixedMethod([methods[fmt] for fmt in formats])

    def _method(self, fmt: BlockFormat | None) -> LinearMethod:
        if fmt is None:
            return UnquantizedMethod(self.dtype, self.packed)
        return BlockQuantizedMethod(fmt, self.packed, exact=not int8_activations(self.matmul, fmt))

    def _format(self, tensor_name: str, embedding: bool) -> BlockFormat | None:
        if self.mode == "none":
            return None
        if self.mode == "int8" or (self.mode == "int4" and embedding):
            return Q8_0
        if self.mode == "int4":
            return Q4_1
        return self.file_formats.get(tensor_name)  # auto: the format it is stored in (None: float)

    @property
    def wants_blocks(self) -> bool:
        """Whether the source should hand over GGUF blocks as they are stored."""
        return self.mode != "none"
