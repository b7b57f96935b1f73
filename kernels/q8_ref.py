"""The int8-activation path of the block kernel (kernels/q8_linear.h) in plain torch: its reference, with the same
signature as cpu_quant.quant_linear_ref.

Each input row is quantized alone to int8: in blocks of 32 with scale absmax / 127 for Q8_0 / Q4_1 / Q5_0; for the K
formats in blocks of 256 with a float scale D and an integer u_s (at most 63, Q6_K's 7) per 32, the steps of the
kernel's own float32 arithmetic; values rounded to nearest even. The integer dot products of the blocks are exact; the
float steps here are float64, so the kernel's float32 sums differ from this by their rounding alone.
"""

from __future__ import annotations

import torch

from plait.kernels.cpu_quant import GROUP, SUPER, BlockFormat, _k_ints, _weight_ints, deinterleave


def quantize_input_q8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as the kernel quantizes them for the 32-weight formats: int8 values [M, K / block, block] (as
    float) and scales [M, K / block] (absmax / 127)."""
    g = x.float().reshape(x.shape[0], x.shape[1] // block, block)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(g * inv[..., None]), amax / 127


def quantize_input_q8k(x: torch.Tensor, units: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as the kernel quantizes them for the K formats: values [M, K / 256, 256] (as float), block
    scales D [M, K / 256] and the integers u_s [M, K / 256, 8] (each value is D u_s q)."""
    g = x.float().reshape(x.shape[0], x.shape[1] // SUPER, 8, 32)
    amax = g.abs().amax(-1)  # [M, B, 8]
    d = amax.amax(-1) / torch.tensor(127.0 * units)  # float32 throughout, as the kernel
    level = torch.tensor(127.0) * d
    u = torch.where(d[..., None] > 0, torch.ceil(amax / level[..., None]).clamp(max=units), torch.zeros_like(amax))
    step = d[..., None] * u
    inv = torch.where(u > 0, 1 / step, torch.zeros_like(step))
    return torch.round(g * inv[..., None]).reshape(x.shape[0], -1, SUPER), d, u


def quant_linear_q8_ref(x: torch.Tensor, tiled: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """The kernel's int8 arithmetic (float64; blocks in the kernel's layout): x quantized per block to int8, integer
    dot products per block, then d_w d_x per block (K formats: less dmin_w d_x times the minimums against the
    input's sums per 32; Q4_1: plus min_w d_x times the input block's sum)."""
    plain = deinterleave(tiled, fmt)
    if fmt.super_block:
        qw, dw, dmin, mins = _k_ints(plain, fmt)  # q times its scale (Q6_K: (q - 32) times it)
        qx, dx, u = quantize_input_q8k(x, 7 if fmt.name == "q6_k" else 63)
        qxu = (qx.double().reshape(*qx.shape[:2], 8, 32) * u.double()[..., None]).reshape(qx.shape)  # in units of D
        y = torch.einsum("mbi,nbi->mnb", qxu, qw.double()) * (dw.double()[None] * dx.double()[:, None])
        if dmin is not None:
            xs = qxu.reshape(*qx.shape[:2], 8, 32).sum(-1)  # [M, B, 8]
            y = y - torch.einsum("mbs,nbs->mnb", xs, mins.double()) * (dmin.double()[None] * dx.double()[:, None])
    else:
        qw, dw, mw = _weight_ints(plain, fmt)  # Q5_0: q - 16
        qx, dx = quantize_input_q8(x, GROUP)
        y = torch.einsum("mgi,ngi->mng", qx.double(), qw.double()) * (dw.double()[None] * dx.double()[:, None])
        if mw is not None:
            y = y + mw.double()[None] * (dx.double() * qx.double().sum(-1))[:, None]
    y = y.sum(-1)
    return (y if bias is None else y + bias.double()).float()
