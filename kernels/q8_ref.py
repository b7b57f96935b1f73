"""The int8-activation path of the block kernel (kernels/q8_linear.h) in plain torch: its reference, with the same
signature as cpu_quant.quant_linear_ref.

Each input row is quantized alone to int8 in blocks (256 values for the K formats, 32 for the others): scale
absmax / 127 (float32), values rounded to nearest even. The integer dot products of the blocks are exact; the float
steps here are float64, so the kernel's float32 sums differ from this by their rounding alone.
"""

from __future__ import annotations

import torch

from plait.kernels.cpu_quant import GROUP, SUPER, BlockFormat, _k_ints, _weight_ints, deinterleave


def quantize_input_q8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as the kernel quantizes them: int8 values [M, K / block, block] (as float) and scales
    [M, K / block] (absmax / 127)."""
    g = x.float().reshape(x.shape[0], x.shape[1] // block, block)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(g * inv[..., None]), amax / 127


def quant_linear_q8_ref(x: torch.Tensor, tiled: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """The kernel's int8 arithmetic (float64; blocks in the kernel's layout): x quantized per block to int8, integer
    dot products per block, then d_w d_x per block (K formats: less dmin_w d_x times the minimums against the
    input's sums per 32; Q4_1: plus min_w d_x times the input block's sum)."""
    plain = deinterleave(tiled, fmt)
    if fmt.super_block:
        qw, dw, dmin, mins = _k_ints(plain, fmt)  # q times its scale (Q6_K: (q - 32) times it)
        qx, dx = quantize_input_q8(x, SUPER)
        y = torch.einsum("mbi,nbi->mnb", qx.double(), qw.double()) * (dw.double()[None] * dx.double()[:, None])
        if dmin is not None:
            xs = qx.double().reshape(*qx.shape[:2], 8, 32).sum(-1)  # [M, B, 8]
            y = y - torch.einsum("mbs,nbs->mnb", xs, mins.double()) * (dmin.double()[None] * dx.double()[:, None])
    else:
        qw, dw, mw = _weight_ints(plain, fmt)  # Q5_0: q - 16
        qx, dx = quantize_input_q8(x, GROUP)
        y = torch.einsum("mgi,ngi->mng", qx.double(), qw.double()) * (dw.double()[None] * dx.double()[:, None])
        if mw is not None:
            y = y + mw.double()[None] * (dx.double() * qx.double().sum(-1))[:, None]
    y = y.sum(-1)
    return (y if bias is None else y + bias.double()).float()
