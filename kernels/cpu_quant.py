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

from plait.kernels import cpu_fused
from plait.kernels.cpu_build import F32, I64, INT, PTR, load_library

GROUP = 32  # weights per block
AS_IS, RMS_NORM, SILU_MUL, ADD_RMS_NORM = 0, 1, 2, 3  # the kernel's input prologues (kernels/quant_linear.c)


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


def _fields(fmt: BlockFormat) -> list[int]:
    """A block's fields, in bytes: scale and integers (Q8_0); scale, minimum and integers (Q4_1)."""
    return [2, 32] if fmt is Q8_0 else [2, 2, 16]


def interleave(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The kernel's layout of plain blocks [N, row bytes]. Within each whole tile of 4 rows, block g of
    every row, then block g + 1 (one sequential stream per tile), each tile block field by field: the
    4 rows' scales, (Q4_1) their 4 minimums, then their integers, so one load reads all 4 scales.
    Rows past the last whole tile stay plain."""
    n4, g = blocks.shape[0] // TILE * TILE, blocks.shape[1] // fmt.block_bytes
    tiles = blocks[:n4].reshape(n4 // TILE, TILE, g, fmt.block_bytes).transpose(1, 2)  # [T, G, 4, bytes]
    parts = tiles.split(_fields(fmt), -1)
    grouped = torch.cat([p.reshape(n4 // TILE, g, TILE * f) for p, f in zip(parts, _fields(fmt))], -1)
    grouped = grouped.reshape(n4, blocks.shape[1])
    return torch.cat([grouped, blocks[n4:]]).contiguous()


def _tile_blocks(tiled: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The whole tiles of the kernel's layout as plain blocks [T, G, 4, block bytes]."""
    n4, g = tiled.shape[0] // TILE * TILE, tiled.shape[1] // fmt.block_bytes
    grouped = tiled[:n4].view(n4 // TILE, g, TILE * fmt.block_bytes)
    parts = grouped.split([TILE * f for f in _fields(fmt)], -1)
    return torch.cat([p.reshape(p.shape[0], g, TILE, f) for p, f in zip(parts, _fields(fmt))], -1)


def deinterleave(tiled: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Plain blocks from the kernel's layout (the inverse of `interleave`)."""
    n4 = tiled.shape[0] // TILE * TILE
    tiles = _tile_blocks(tiled, fmt).transpose(1, 2).reshape(n4, tiled.shape[1])
    return torch.cat([tiles, tiled[n4:]]).contiguous()


def tiled_rows(tiled: torch.Tensor, fmt: BlockFormat, ids: torch.Tensor) -> torch.Tensor:
    """Plain blocks of rows `ids` read from the kernel's layout (an embedding lookup: only their tiles are read)."""
    n4, g = tiled.shape[0] // TILE * TILE, tiled.shape[1] // fmt.block_bytes
    if not bool((ids < n4).all()):
        return torch.stack([tiled_rows(tiled, fmt, i.view(1))[0] if i < n4 else tiled[i] for i in ids])
    tile_blocks = tiled[:n4].view(n4 // TILE, g, TILE * fmt.block_bytes)[ids // TILE]  # [I, G, 4 * block bytes]
    base, size = _row_bytes_in_tile(fmt)
    pos = base + (ids % TILE)[:, None] * size  # [I, block bytes]: where row i's block bytes are in a tile block
    return tile_blocks.gather(2, pos[:, None, :].expand(-1, g, -1)).reshape(ids.numel(), tiled.shape[1])


@functools.lru_cache(maxsize=None)
def _row_bytes_in_tile(fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """For each byte of a plain block, its offset in a tile block for the tile's row 0, and the step per row."""
    base, size, start = [], [], 0
    for f in _fields(fmt):
        base += [TILE * start + i for i in range(f)]
        size += [f] * f
        start += f
    return torch.tensor(base), torch.tensor(size)


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
    return QuantMatmul(tiled, fmt, bias)(x)


class QuantMatmul:
    """`quant_linear` for one weight (and bias), checked once here, so a call checks only x: a decode
    step makes a hundred or more of these calls, each a few microseconds of Python. `normed`,
    `add_normed` and `silu_mul` fuse the step before the matmul into the kernel's input quantization
    (one call instead of two; the same result as the two)."""

    def __init__(self, tiled: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None):
        self.tiled, self.fmt, self.bias = tiled, fmt, bias
        self.n, self.k = tiled.shape[0], tiled.shape[1] // fmt.block_bytes * GROUP
        lib = _library()
        fits = tiled.is_contiguous() and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous()))
        self._fn = lib.quant_linear if lib is not None and fits else None
        self._w, self._b = tiled.data_ptr(), None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fits(x, self.k):
            return self._run(x, AS_IS, None, 0.0)
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x of shape {tuple(x.shape)}: the weight takes [rows, {self.k}] features")
        if self._fn is None or x.dtype is not torch.float32 or not x.is_cpu:
            return quant_linear_ref(x, self.tiled, self.fmt, self.bias)
        return self._run(x.contiguous(), AS_IS, None, 0.0)

    def normed(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """self(rms_norm(x, w, eps))."""
        if not self._fits(x, self.k) or not self._fits_norm(w):
            return self(cpu_fused.rms_norm(x, w, eps))
        return self._run(x, RMS_NORM, w.data_ptr(), eps)

    def add_normed(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, self(rms_norm(x + residual, w, eps))), the sum written into x as cpu_fused.add_rms_norm."""
        if (not self._fits(x, self.k) or not self._fits(residual, self.k) or residual.shape != x.shape
                or not self._fits_norm(w)):
            x, h = cpu_fused.add_rms_norm(x, residual, w, eps)
            return x, self(h)
        return x, self._run(x, ADD_RMS_NORM, w.data_ptr(), eps, residual.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up [M, 2K] = gate | up."""
        if not self._fits(gate_up, 2 * self.k):
            return self(cpu_fused.silu_mul(gate_up))
        return self._run(gate_up, SILU_MUL, None, 0.0)

    def _fits(self, x: torch.Tensor, cols: int) -> bool:
        return (self._fn is not None and x.dtype is torch.float32 and x.is_cpu and x.dim() == 2
                and x.shape[1] == cols and x.is_contiguous())

    def _fits_norm(self, w: torch.Tensor) -> bool:
        return w.dtype is torch.float32 and w.shape == (self.k,) and w.is_contiguous()

    def _run(self, x: torch.Tensor, prologue: int, norm_w: int | None, eps: float, residual: int | None = None
             ) -> torch.Tensor:
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        self._fn(x.data_ptr(), self._w, self._b, y.data_ptr(), x.shape[0], self.n, self.k, self.fmt.code, prologue,
                 norm_w, eps, residual, torch.get_num_threads())
        return y


def quant_rows(tiled: torch.Tensor, fmt: BlockFormat, ids: torch.Tensor) -> torch.Tensor:
    """dequantize(tiled_rows(tiled, fmt, ids)): float32 rows [len(ids), K] (an embedding lookup), by the C
    kernel where it applies."""
    ids = ids.to(torch.int64).contiguous()
    if ids.numel():
        lo, hi = torch.aminmax(ids)
        if int(lo) < 0 or int(hi) >= tiled.shape[0]:
            raise IndexError(f"row ids must be in [0, {tiled.shape[0]}), got {int(lo)}..{int(hi)}")
    lib = _library()
    if lib is None or not tiled.is_contiguous():
        return dequantize(tiled_rows(tiled, fmt, ids), fmt)
    k = tiled.shape[1] // fmt.block_bytes * GROUP
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    lib.quant_rows(tiled.data_ptr(), ids.data_ptr(), ids.numel(), tiled.shape[0], k, fmt.code, out.data_ptr())
    return out


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return load_library("quant_linear", quant_linear=(PTR, PTR, PTR, PTR, I64, I64, I64, INT, INT, PTR, F32, PTR, INT),
                        quant_rows=(PTR, PTR, I64, I64, I64, INT, PTR))
