"""Linear layers: the fastest matmul for the device and the number of rows.

On CPU in float32, few-row matmuls (decode steps) go to a C kernel that streams the plain weight
at near the read bandwidth. Many-row matmuls (prefill, large decode batches) go to oneDNN with a
pre-packed ("reordered") copy of the weight where the model made one: 10-40% faster here than
`F.linear` (MKL), most of all for the wide LM head. Everything else runs `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.kernels.cpu_linear import MAX_ROWS, skinny_linear


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a float32 CPU weight [out, in], or None where it does not apply."""
    if (w.device.type != "cpu" or w.dtype != torch.float32 or not torch.backends.mkldnn.is_available()
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)`; `packed` is `pack(w)` or None."""
    if packed is not None and x.dim() == 2 and x.shape[0] > MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    return skinny_linear(x, w, b)
