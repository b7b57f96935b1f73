"""Linear layers: the fastest matmul for the device, the weight's dtype and the number of rows.

Activations are float32 on CPU; weights are float32, bfloat16 or float16. Few-row matmuls (decode
steps) go to a C kernel that streams the plain weight at near the read bandwidth, widening 16-bit
weights on load. Many-row matmuls (prefill, large decode batches) go to oneDNN with a pre-packed
("reordered") copy of the weight where the model made one: 10-40% faster here than `F.linear`
(MKL), most of all for the wide LM head. The packed copy is bfloat16 only where the CPU has native
bf16 dot products (AVX512-BF16); elsewhere it is float32, since oneDNN's emulated bf16 GEMM is
slower than its float32 one. With `batch_invariant` every row count goes to the C kernel, whose
per-row sums never depend on the batch (see kernels/skinny_linear.c). A bfloat16 weight also gets
the kernel's blocked layout (one sequential stream per 4 rows), so it keeps a plain, a blocked and
a float32 oneDNN copy: 1.0x the memory of float32 with its two copies, and half the bytes per
decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.kernels import cpu_isa
from plait.kernels.cpu_linear import MAX_ROWS, block_bf16, skinny_linear


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


def pack(w: torch.Tensor, dtype: torch.dtype | None = None) -> PackedWeight | None:
    """The packed copies of a CPU weight [out, in] (oneDNN's in `dtype`, default `packed_dtype(w.dtype)`),
    or None where none applies."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    onednn = None
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        onednn = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype or packed_dtype(w.dtype)).contiguous(), 1)
    return PackedWeight(onednn, block_bf16(w.contiguous()))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, packed: PackedWeight | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """`F.linear(x, w, b)` in x's dtype; `packed` is `pack(w)` or None."""
    onednn = packed.onednn if packed is not None else None
    if onednn is not None and x.dim() == 2 and x.shape[0] > MAX_ROWS and not batch_invariant:
        if onednn.dtype == x.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, onednn, b, "none", [], "")
        bias = None if b is None else b.to(onednn.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.to(onednn.dtype), onednn, bias, "none", [], "").to(x.dtype)
    return skinny_linear(x, w, b, batch_invariant, packed.kernel if packed is not None else None)
