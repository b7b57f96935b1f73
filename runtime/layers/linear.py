"""Linear layers in the fastest weight layout for the device.

On CPU, torch's default fp32 GEMM (MKL, `F.linear`) is 2-4x slower here than oneDNN with a
pre-packed ("reordered") weight for the skinny matrices of decoding (few rows, wide weight).
`pack` converts a weight once after loading; `linear` dispatches on the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_pack(w: torch.Tensor) -> bool:
    return (
        w.device.type == "cpu"
        and w.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack(w: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout where that helps, else unchanged."""
    if not can_pack(w):
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)
