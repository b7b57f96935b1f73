"""Block-quantized weights on CPU: GGUF's Q8_0 and Q4_1 blocks, and the few-row matmul kernel over them
(kernels/quant_linear.c: exact integer dot products against activations quantized to int16 per
block) with its torch reference.

A quantized weight [N, K] is a uint8 tensor [N, K / 32 * block bytes]: each row is its K / 32 blocks
in llama.cpp's layout, so a GGUF file's blocks load as they are stored (Q4_0 converts to Q4_1
exactly: its implicit offset -8 becomes the block minimum -8 d). `quantize` makes the same blocks
from a float weight (int8: symmetric absmax scales; int4: per-block min and scale); `dequantize` is
the weight the blocks stand for (many-row matmuls use a float copy of it).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from plait.kernels.cpu_build import I64, INT, PTR, load_library

GROUP = 32  # weights per block


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # the kernel's fmt argument (kernels/quant_linear.c)
    block_bytes: int
    ggml_type: int  # GGUF's type number

    def row_bytes(self, k: int) -> int:
        return k // GROUP * self.block_bytes


Q8_0 = BlockFormat("q8_0", 0, 34, 8)
Q4_1 = BlockFormat("q4_1", 1, 20, 3)
_Q4_0_TYPE = 2
BY_GGML_TYPE = {Q8_0.ggml_type: Q8_0, Q4_1.ggml_type: Q4_1, _Q4_0_TYPE: Q4_1}  # GGUF types served as blocks


@dataclass(frozen=True)
class BlockTensor:
    """A checkpoint tensor [N, K] kept as its plain blocks [N, K / 32 * block bytes] (from a GGUF file)."""

    blocks: torch.Tensor
    fmt: BlockFormat
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.blocks, self.fmt)


def _halves(x: torch.Tensor) -> torch.Tensor:
    """float16 values [..., G] as their bytes [..., G, 2]."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def quantize(w: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Blocks of a float weight [N, K] (K a multiple of 32)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"{fmt.name} needs in_features divisible by {GROUP}, got {k}")
    g = w.float().reshape(n, k // GROUP, GROUP)
    if fmt is Q8_0:
        d = (g.abs().amax(-1) / 127).to(torch.float16).float()
        q = torch.where(d[..., None] > 0, g / d.clamp_min(1e-30)[..., None], 0).round().clamp(-127, 127)
        parts = [_halves(d), q.to(torch.int8).view(torch.uint8)]
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        m = lo.to(torch.float16).float()
        d = ((hi - m) / 15).to(torch.float16).float()
        q = torch.where(d[..., None] > 0, (g - m[..., None]) / d.clamp_min(1e-30)[..., None], 0)
        q = q.round().clamp(0, 15).to(torch.uint8)
        parts = [_halves(d), _halves(m), q[..., :16] | (q[..., 16:] << 4)]
    return torch.cat(parts, -1).reshape(n, -1).contiguous()


def _weight_ints(blocks: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Plain blocks as their integers [N, G, 32], scales [N, G] and (Q4_1) minimums [N, G]."""
    b = blocks.reshape(blocks.shape[0], blocks.shape[1] // fmt.block_bytes, fmt.block_bytes)
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    if fmt is Q8_0:
        return b[..., 2:].contiguous().view(torch.int8).float(), d, None
    qs = b[..., 4:]
    m = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    return torch.cat([qs & 0xF, qs >> 4], -1).float(), d, m


def dequantize(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """float32 [N, K] from plain blocks [N, K / 32 * block bytes], as the kernel computes each weight."""
    q, d, m = _weight_ints(blocks, fmt)
    w = q * d[..., None] if m is None else torch.addcmul(m[..., None], q, d[..., None])  # one rounding, as an FMA
    return w.reshape(blocks.shape[0], -1)


def from_gguf(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """A GGUF tensor's blocks [N, row bytes] in the format BY_GGML_TYPE names (Q4_0 becomes Q4_1)."""
    if ggml_type != _Q4_0_TYPE:
        return raw
    b = raw.reshape(raw.shape[0], -1, 18)
    d = b[..., 0:2].contiguous().view(torch.float16)
    m = -8 * d.float()
    if not torch.isfinite(m.to(torch.float16)).all():
        raise ValueError("Q4_0 block scale too large to convert to Q4_1")
    parts = [b[..., 0:2], _halves(m.squeeze(-1)).view(*m.shape[:-1], 2), b[..., 2:]]
    return torch.cat(parts, -1).reshape(raw.shape[0], -1).contiguous()


TILE = 4  # rows per kernel tile (TILE_N of kernels/quant_linear.c)


def interleave(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The kernel's layout of plain blocks [N, row bytes]: within each whole tile of 4 rows, block g
    of every row, then block g + 1 (one sequential stream per tile); rows past the last tile plain."""
    n4 = blocks.shape[0] // TILE * TILE
    tiles = blocks[:n4].reshape(n4 // TILE, TILE, -1, fmt.block_bytes).transpose(1, 2).reshape(n4, -1)
    return torch.cat([tiles, blocks[n4:]]).contiguous()


def deinterleave(tiled: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Plain blocks from the kernel's layout (the inverse of `interleave`)."""
    n4 = tiled.shape[0] // TILE * TILE
    tiles = tiled[:n4].reshape(n4 // TILE, -1, TILE, fmt.block_bytes).transpose(1, 2).reshape(n4, -1)
    return torch.cat([tiles, tiled[n4:]]).contiguous()


def tiled_rows(tiled: torch.Tensor, fmt: BlockFormat, ids: torch.Tensor) -> torch.Tensor:
    """Plain blocks of rows `ids` read from the kernel's layout (an embedding lookup)."""
    n4 = tiled.shape[0] // TILE * TILE
    tiles = tiled[:n4].view(n4 // TILE, -1, TILE, fmt.block_bytes)
    in_tile = ids < n4
    if bool(in_tile.all()):
        return tiles[ids // TILE, :, ids % TILE].reshape(ids.numel(), -1)
    return torch.stack([tiles[i // TILE, :, i % TILE].reshape(-1) if i < n4 else tiled[i] for i in ids.tolist()])


def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as the kernel quantizes them: int16 values [M, G, 32] (as float), scales and
    float sums [M, G] (per block of 32: absmax / 32767, round to nearest even)."""
    g = x.float().reshape(x.shape[0], x.shape[1] // GROUP, GROUP)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
    return torch.round(g * inv[..., None]), amax / 32767, g.sum(-1)


def quant_linear_ref(x: torch.Tensor, tiled: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The kernel's arithmetic, exactly (float64; blocks in the kernel's layout): x quantized per block,
    integer dot products per block, then d_w * d_x (and Q4_1's min_w * sum(x)) per block."""
    qw, dw, mw = _weight_ints(deinterleave(tiled, fmt), fmt)
    qx, dx, sx = quantize_input(x)
    dots = torch.einsum("mgi,ngi->mng", qx.double(), qw.double())
    y = (dots * (dw.double()[None] * dx.double()[:, None])).sum(-1)
    if mw is not None:
        y = y + (mw.double()[None] * sx.double()[:, None]).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.float()


def quant_linear(x: torch.Tensor, tiled: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x @ dequantize(w).T (+ bias) for a 2-D float32 x with the activations quantized to int16 per block:
    `quant_linear_ref`, by the C kernel where it applies (any row count; its per-row sums never depend
    on the batch). `tiled` is `interleave(blocks)`."""
    lib = _library()
    if (lib is None or x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2 or not tiled.is_contiguous()
            or (bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()))):
        return quant_linear_ref(x, tiled, fmt, bias)
    n, k = tiled.shape[0], tiled.shape[1] // fmt.block_bytes * GROUP
    rows, cols = x.shape
    if cols != k:
        raise ValueError(f"x has {cols} features, the weight {k}")
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    lib.quant_linear(x.data_ptr(), tiled.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                     rows, n, k, fmt.code, torch.get_num_threads())
    return y


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return load_library("quant_linear", quant_linear=(PTR, PTR, PTR, PTR, I64, I64, I64, INT, INT))
