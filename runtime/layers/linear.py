"""Linear layers: the fastest matmul for the device and the number of rows.

Weights stay in torch's plain layout (one copy). On CPU, few-row float32 matmuls (decode steps)
go to a C kernel that streams the weight at near the read bandwidth; the rest to `F.linear`.
"""

from __future__ import annotations

import torch

from plait.kernels.cpu_linear import skinny_linear


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return skinny_linear(x, w, b)
