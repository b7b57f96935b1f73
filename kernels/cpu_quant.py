"""Block-quantized weights on CPU: llama.cpp's block formats, and the few-row matmul kernel over them
(kernels/quant_linear.c and kernels/kquant.h: exact integer dot products against activations quantized to
int16 per block) with its torch reference.

Formats: Q8_0, Q4_1 (Q4_0 converts to it exactly: its implicit offset -8 becomes the block minimum -8 d) and
Q5_0 in blocks of 32; the "K" formats Q4_K, Q5_K and Q6_K in super-blocks of 256 with 6- or 8-bit
sub-block scales. A quantized weight [N, K] is a uint8 tensor [N, K / block size * block bytes]: each row
its blocks, in llama.cpp's layout, except that Q5_K's and Q6_K's high bits become bit planes and Q6_K's
fields are reordered (`from_gguf`, same bytes; kernels/kquant.h describes the layouts), so a GGUF file's
blocks load with no float round trip. `quantize` makes blocks from a float weight; `dequantize` is the
weight the blocks stand for.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from plait.kernels import cpu_fused
from plait.kernels.cpu_build import F32, I64, INT, PTR, load_library

GROUP = 32  # weights per block (per sub-block in the K formats): the unit activations are summed in
SUPER = 256  # weights per K-format block
AS_IS, RMS_NORM, SILU_MUL, ADD_RMS_NORM, GELU_MUL = 0, 1, 2, 3, 4  # the kernel's input prologues (quant_linear.c)


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # the kernel's fmt argument (kernels/quant_linear.c)
    block_bytes: int
    ggml_type: int  # GGUF's type number
    block_size: int  # weights per block
    fields: tuple[int, ...]  # bytes of a block's fields in the kernel's layout, in order

    def row_bytes(self, k: int) -> int:
        return k // self.block_size * self.block_bytes

    @property
    def super_block(self) -> bool:
        return self.block_size == SUPER


Q8_0 = BlockFormat("q8_0", 0, 34, 8, GROUP, (2, 32))  # d, 32 int8
Q4_1 = BlockFormat("q4_1", 1, 20, 3, GROUP, (2, 2, 16))  # d, m, 16 bytes of nibbles
Q5_0 = BlockFormat("q5_0", 2, 22, 6, GROUP, (2, 4, 16))  # d, high bits (u32), nibbles
Q4_K = BlockFormat("q4_k", 3, 144, 12, SUPER, (2, 2, 12, 128))  # d, dmin, 6-bit scales and mins, nibbles
Q5_K = BlockFormat("q5_k", 4, 176, 13, SUPER, (2, 2, 12, 32, 128))  # ... bit planes, nibbles
Q6_K = BlockFormat("q6_k", 5, 210, 14, SUPER, (2, 16, 64, 128))  # d, int8 scales per 16, 2 planes, nibbles
FORMATS = (Q8_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K)
_Q4_0_TYPE = 2
BY_GGML_TYPE = {**{f.ggml_type: f for f in FORMATS}, _Q4_0_TYPE: Q4_1}  # GGUF types served as blocks


@dataclass(frozen=True)
class BlockTensor:
    """A checkpoint tensor [N, K] kept as its plain blocks [N, row bytes] (from a GGUF file)."""

    blocks: torch.Tensor
    fmt: BlockFormat
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.blocks, self.fmt)


def _halves(x: torch.Tensor) -> torch.Tensor:
    """float16 values [..., G] as their bytes [..., G, 2]."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 2] as float32 [...]."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _split(blocks: torch.Tensor, fmt: BlockFormat) -> list[torch.Tensor]:
    """Plain blocks [N, row bytes] as their fields [N, blocks, field bytes]."""
    b = blocks.reshape(blocks.shape[0], blocks.shape[1] // fmt.block_bytes, fmt.block_bytes)
    return list(b.split(list(fmt.fields), -1))


def _bits(x: torch.Tensor, n: int) -> torch.Tensor:
    """Little-endian bytes [..., n / 8] as bits [..., n] (0/1, uint8)."""
    return ((x[..., :, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(*x.shape[:-1], n)


def _pack_bits(b: torch.Tensor) -> torch.Tensor:
    """Bits [..., n] (0/1) as little-endian bytes [..., n / 8]."""
    b = b.to(torch.uint8).reshape(*b.shape[:-1], -1, 8)
    return (b << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def _nibble_pairs(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [..., 256] (sub-blocks of 32) packed as the K formats store them: byte l of pair p holds
    element l of sub-block 2p (low nibble) and of 2p + 1 (high)."""
    q = q.reshape(*q.shape[:-1], 4, 2, 32)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:-3], 128)


def _unpair(qs: torch.Tensor) -> torch.Tensor:
    """The inverse of `_nibble_pairs`: [..., 128] bytes -> 4-bit values [..., 256]."""
    qs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([qs & 0xF, qs >> 4], -2).reshape(*qs.shape[:-3], 256)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 8 6-bit scales and mins [..., 8] from their 12 bytes (GGUF's get_scale_min_k4)."""
    q = packed.long()
    sc = torch.cat([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def _pack_k_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The inverse of `_k_scales`: 6-bit scales and mins [..., 8] as 12 bytes."""
    sc, m = sc.long(), m.long()
    low = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6)], -1)
    high = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    return torch.cat([low, high], -1).to(torch.uint8)


def _k_ints(blocks: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                 torch.Tensor | None]:
    """K-format plain blocks as (integer weights times their sub-block scale [N, B, 256], d [N, B], and for
    Q4_K/Q5_K dmin [N, B] and the integer mins [N, B, 8])."""
    f = _split(blocks, fmt)
    if fmt is Q6_K:
        scale = f[1].contiguous().view(torch.int8).long().repeat_interleave(16, -1)
        return _q6_values(blocks).long() * scale, _f16(f[0]), None, None
    d, dmin, packed, *rest = f
    q = _unpair(rest[-1]).long()
    if fmt is Q5_K:
        q = q + (_bits(rest[0], 256).long() << 4)
    sc, m = _k_scales(packed)
    return q * sc.repeat_interleave(32, -1), _f16(d), _f16(dmin), m


def _weight_ints(blocks: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """32-weight plain blocks as their integers [N, G, 32], scales [N, G] and (Q4_1) minimums [N, G]."""
    f = _split(blocks, fmt)
    d = _f16(f[0])
    if fmt is Q8_0:
        return f[1].contiguous().view(torch.int8).float(), d, None
    qs = f[-1]
    q = torch.cat([qs & 0xF, qs >> 4], -1).float()
    if fmt is Q5_0:
        return q + _bits(f[1], 32).float() * 16 - 16, d, None
    return q, d, _f16(f[1])


def dequantize(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """float32 [N, K] from plain blocks [N, row bytes], as the kernel's row lookup computes each weight."""
    return _by_chunks(_dequantize, blocks, fmt)


def _dequantize(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    n = blocks.shape[0]
    if fmt.super_block:
        f = _split(blocks, fmt)
        if fmt is Q6_K:  # (d sc) (q - 32), the kernel's order of rounding
            d, sc = _f16(f[0]), f[1].contiguous().view(torch.int8).float()
            return ((d[..., None] * sc).repeat_interleave(16, -1) * _q6_values(blocks)).reshape(n, -1)
        sc, m = _k_scales(f[2])
        q = _unpair(f[-1]).float()
        if fmt is Q5_K:
            q = q + _bits(f[3], 256).float() * 16
        d1 = (_f16(f[0])[..., None] * sc.float()).repeat_interleave(32, -1)
        m1 = (_f16(f[1])[..., None] * m.float()).repeat_interleave(32, -1)
        return torch.addcmul(-m1, d1, q).reshape(n, -1)  # one rounding, as the kernel's fmaf
    q, d, m = _weight_ints(blocks, fmt)
    w = q * d[..., None] if m is None else torch.addcmul(m[..., None], q, d[..., None])  # one rounding, as an FMA
    return w.reshape(n, -1)


def _q6_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K plain blocks as q - 32 [N, B, 256] (float)."""
    _, _, planes, qs = _split(blocks, Q6_K)
    q = _unpair(qs).long()
    return (q + (_q6k_high(planes).long() << 4).reshape(q.shape) - 32).float()


# rows converted at a time (a multiple of TILE): the repacks' intermediates stay a few MB (an LM head: 150k rows)
_CHUNK_ROWS = 2048


def _by_chunks(fn, blocks: torch.Tensor, *args) -> torch.Tensor:
    if blocks.shape[0] <= _CHUNK_ROWS:
        return fn(blocks, *args)
    return torch.cat([fn(blocks[i : i + _CHUNK_ROWS], *args) for i in range(0, blocks.shape[0], _CHUNK_ROWS)])


def from_gguf(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """A GGUF tensor's blocks [N, row bytes] in the plain layout of the format BY_GGML_TYPE names: Q4_0 becomes
    Q4_1; Q5_K's high bits become bit planes; Q6_K's fields are reordered, its high bits planes and its low
    nibbles paired as Q4_K's. Other formats are kept as they are."""
    if ggml_type not in (_Q4_0_TYPE, Q5_K.ggml_type, Q6_K.ggml_type):
        return raw
    lib = _library()
    # _repack's Q6_K branch in C, the same bytes (in torch it took 2.7 s of the 1.5B's load)
    if ggml_type == Q6_K.ggml_type and lib is not None:
        raw = raw.contiguous()
        out = torch.empty_like(raw)
        lib.q6k_from_gguf(raw.data_ptr(), out.data_ptr(), raw.numel() // Q6_K.block_bytes)
        return out
    return _by_chunks(_repack, raw, ggml_type)


def _repack(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    n = raw.shape[0]
    if ggml_type == _Q4_0_TYPE:
        b = raw.reshape(n, -1, 18)
        d = b[..., 0:2].contiguous().view(torch.float16)
        m = -8 * d.float()
        if not torch.isfinite(m.to(torch.float16)).all():
            raise ValueError("Q4_0 block scale too large to convert to Q4_1")
        parts = [b[..., 0:2], _halves(m.squeeze(-1)).view(*m.shape[:-1], 2), b[..., 2:]]
        return torch.cat(parts, -1).reshape(n, -1).contiguous()
    if ggml_type == Q5_K.ggml_type:  # d, dmin, scales, qh[32] (bit s of byte l: sub-block s, element l), qs
        b = raw.reshape(n, -1, 176)
        planes = _pack_bits(_bits(b[..., 16:48], 256).reshape(n, -1, 32, 8).transpose(-1, -2)).reshape(n, -1, 32)
        return torch.cat([b[..., :16], planes, b[..., 48:]], -1).reshape(n, -1).contiguous()
    if ggml_type == Q6_K.ggml_type:  # ql[128], qh[64], scales[16], d
        b = raw.reshape(n, -1, 210)
        ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208], b[..., 208:]
        halves = []
        for h in range(2):  # each 128 weights: ql[64h:64h + 64], qh[32h:32h + 32]
            lo, hi = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
            for j in range(4):  # element l + 32 j takes ql's low (j even) or high nibble and qh's bits 2j, 2j + 1
                nib = lo[..., 32 * (j % 2) : 32 * (j % 2) + 32]
                nib = nib & 0xF if j < 2 else nib >> 4
                halves.append(nib | (((hi >> (2 * j)) & 3) << 4))
        q = torch.stack(halves, -2)  # [N, B, 8, 32]: sub-block s, element l
        planes = torch.stack([(q >> 4) & 1, (q >> 5) & 1], -2)  # [N, B, 8, 2, 32]
        parts = [d, sc, _pack_bits(planes).reshape(n, -1, 64), _nibble_pairs((q & 0xF).reshape(n, -1, 256))]
        return torch.cat(parts, -1).reshape(n, -1).contiguous()
    raise ValueError(f"no repack for ggml type {ggml_type}")


def quantize(w: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Blocks of a float weight [N, K] (K a multiple of the block size), rounding to nearest (not llama.cpp's
    error-minimising search: this is for checkpoints that hold no blocks, and tests)."""
    n, k = w.shape
    if k % fmt.block_size:
        raise ValueError(f"{fmt.name} needs in_features divisible by {fmt.block_size}, got {k}")
    if fmt.super_block:
        return _quantize_k(w.float().reshape(n, k // SUPER, SUPER), fmt).reshape(n, -1).contiguous()
    g = w.float().reshape(n, k // GROUP, GROUP)
    if fmt is Q8_0:
        d = (g.abs().amax(-1) / 127).to(torch.float16).float()
        q = torch.where(d[..., None] > 0, g / d.clamp_min(1e-30)[..., None], 0).round().clamp(-127, 127)
        parts = [_halves(d), q.to(torch.int8).view(torch.uint8)]
    elif fmt is Q5_0:
        d = (g.abs().amax(-1) / 15).to(torch.float16).float()
        q = (torch.where(d[..., None] > 0, g / d.clamp_min(1e-30)[..., None], 0).round().clamp(-16, 15) + 16)
        q = q.to(torch.uint8)
        parts = [_halves(d), _pack_bits(q >> 4), (q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)]
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        m = lo.to(torch.float16).float()
        d = ((hi - m) / 15).to(torch.float16).float()
        q = torch.where(d[..., None] > 0, (g - m[..., None]) / d.clamp_min(1e-30)[..., None], 0)
        q = q.round().clamp(0, 15).to(torch.uint8)
        parts = [_halves(d), _halves(m), q[..., :16] | (q[..., 16:] << 4)]
    return torch.cat(parts, -1).reshape(n, -1).contiguous()


def _quantize_k(g: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """K-format blocks [N, B, block bytes] of float super-blocks g [N, B, 256]."""
    if fmt is Q6_K:
        s = g.reshape(*g.shape[:-1], 16, 16)
        scale = s.abs().amax(-1) / 31  # per 16 weights
        d = (scale.amax(-1) / 127).to(torch.float16).float()
        sc = torch.where(d[..., None] > 0, scale / d.clamp_min(1e-30)[..., None], 0).round().clamp(-128, 127)
        step = (d[..., None] * sc)[..., None]
        q = torch.where(step > 0, s / step.clamp_min(1e-30), 0).round().clamp(-32, 31) + 32
        q = q.reshape(g.shape).to(torch.uint8).reshape(*g.shape[:-1], 8, 32)
        planes = _pack_bits(torch.stack([(q >> 4) & 1, (q >> 5) & 1], -2)).reshape(*g.shape[:-1], 64)
        return torch.cat([_halves(d), sc.to(torch.int8).view(torch.uint8), planes,
                          _nibble_pairs((q & 0xF).reshape(g.shape))], -1)
    levels = 31 if fmt is Q5_K else 15
    s = g.reshape(*g.shape[:-1], 8, 32)
    lo = s.amin(-1).clamp(max=0)  # the block minimum, never above 0 (llama.cpp's rule)
    scale, mins = (s.amax(-1) - lo) / levels, -lo
    d, dmin = (scale.amax(-1) / 63).to(torch.float16).float(), (mins.amax(-1) / 63).to(torch.float16).float()
    sc = torch.where(d[..., None] > 0, scale / d.clamp_min(1e-30)[..., None], 0).round().clamp(0, 63)
    m = torch.where(dmin[..., None] > 0, mins / dmin.clamp_min(1e-30)[..., None], 0).round().clamp(0, 63)
    step, offset = (d[..., None] * sc)[..., None], (dmin[..., None] * m)[..., None]
    q = torch.where(step > 0, (s + offset) / step.clamp_min(1e-30), 0).round().clamp(0, levels).to(torch.uint8)
    q = q.reshape(g.shape)
    parts = [_halves(d), _halves(dmin), _pack_k_scales(sc, m)]
    if fmt is Q5_K:
        parts.append(_pack_bits((q >> 4).reshape(*g.shape[:-1], 8, 32)).reshape(*g.shape[:-1], 32))
    return torch.cat([*parts, _nibble_pairs(q & 0xF)], -1)


TILE = 4  # rows per kernel tile (TILE_N of kernels/quant_linear.c)


def interleave(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The kernel's layout of plain blocks [N, row bytes]. Within each whole tile of 4 rows, block g of
    every row, then block g + 1 (one sequential stream per tile), each tile block field by field: the
    4 rows' scales, then their next field, ..., then their integers, so one load reads all 4 scales.
    Rows past the last whole tile stay plain."""
    return _by_chunks(_interleave, blocks, fmt)  # tiles are independent; chunks bound the copies


def interleave_(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """`interleave` in place, a tile (C) or a chunk of rows at a time (loading a model then never holds two copies of
    a weight)."""
    lib = _library()
    if lib is not None and blocks.is_contiguous():
        if _packs_high(fmt):
            lib.q6k_pack_high(blocks.data_ptr(), blocks.shape[0] // TILE * TILE * (blocks.shape[1] // fmt.block_bytes))
        fields = torch.tensor(fmt.fields, dtype=torch.int64)
        lib.interleave_tiles(blocks.data_ptr(), blocks.shape[0], blocks.shape[1], fmt.block_bytes, fields.data_ptr(),
                             len(fmt.fields))
        return blocks
    for i in range(0, blocks.shape[0], _CHUNK_ROWS):
        blocks[i : i + _CHUNK_ROWS] = _interleave(blocks[i : i + _CHUNK_ROWS], fmt)
    return blocks


def _interleave(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    n4, g = blocks.shape[0] // TILE * TILE, blocks.shape[1] // fmt.block_bytes
    whole = blocks[:n4]
    if _packs_high(fmt):
        whole = _q6k_pack_high(whole.reshape(n4, g, fmt.block_bytes)).reshape(n4, blocks.shape[1])
    tiles = whole.reshape(n4 // TILE, TILE, g, fmt.block_bytes).transpose(1, 2)  # [T, G, 4, bytes]
    parts = tiles.split(list(fmt.fields), -1)
    grouped = torch.cat([p.reshape(n4 // TILE, g, TILE * f) for p, f in zip(parts, list(fmt.fields))], -1)
    grouped = grouped.reshape(n4, blocks.shape[1])
    return torch.cat([grouped, blocks[n4:]]).contiguous()


def _tile_blocks(tiled: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The whole tiles of the kernel's layout as plain blocks [T, G, 4, block bytes]."""
    n4, g = tiled.shape[0] // TILE * TILE, tiled.shape[1] // fmt.block_bytes
    grouped = tiled[:n4].view(n4 // TILE, g, TILE * fmt.block_bytes)
    parts = grouped.split([TILE * f for f in list(fmt.fields)], -1)
    blocks = torch.cat([p.reshape(p.shape[0], g, TILE, f) for p, f in zip(parts, list(fmt.fields))], -1)
    return _q6k_unpack_high(blocks) if _packs_high(fmt) else blocks


def _q6k_pack_high(blocks: torch.Tensor) -> torch.Tensor:
    """Plain Q6_K blocks [..., 210] with their two bit planes (bit l of plane p of sub-block s: bit 4 + p of element
    l) as whole tiles hold them where q6k_packed(): byte 32 h + l holds element l of sub-blocks 4h .. 4h + 3, 2 bits
    each from bit 0 (kernels/quant_linear.c: q6k_pack_high)."""
    two = _q6k_high(blocks[..., 18:82]).reshape(*blocks.shape[:-1], 2, 4, 32)  # [..., h, j, l]: sub-block 4h + j
    shifts = (2 * torch.arange(4, dtype=torch.uint8))[:, None]
    packed = (two << shifts).sum(-2, dtype=torch.uint8).reshape(*blocks.shape[:-1], 64)
    return torch.cat([blocks[..., :18], packed, blocks[..., 82:]], -1)


def _q6k_unpack_high(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of _q6k_pack_high."""
    packed = blocks[..., 18:82].reshape(*blocks.shape[:-1], 2, 1, 32)
    two = ((packed >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]) & 3).reshape(*blocks.shape[:-1], 8, 32)
    planes = _pack_bits(torch.stack([two & 1, two >> 1], -2)).reshape(*blocks.shape[:-1], 64)
    return torch.cat([blocks[..., :18], planes, blocks[..., 82:]], -1)


def _q6k_high(planes: torch.Tensor) -> torch.Tensor:
    """Q6_K's two bit planes [..., 64] as each element's high 2 bits (0..3) [..., 8 sub-blocks, 32]."""
    bits = _bits(planes, 512).reshape(*planes.shape[:-1], 8, 2, 32)
    return bits[..., 0, :] | (bits[..., 1, :] << 1)


def deinterleave(tiled: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Plain blocks from the kernel's layout (the inverse of `interleave`)."""
    return _by_chunks(_deinterleave, tiled, fmt)


def _deinterleave(tiled: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
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
    rows = tile_blocks.gather(2, pos[:, None, :].expand(-1, g, -1))  # [I, G, block bytes]
    rows = _q6k_unpack_high(rows) if _packs_high(fmt) else rows
    return rows.reshape(ids.numel(), tiled.shape[1])


@functools.lru_cache(maxsize=None)
def _row_bytes_in_tile(fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """For each byte of a plain block, its offset in a tile block for the tile's row 0, and the step per row."""
    base, size, start = [], [], 0
    for f in list(fmt.fields):
        base += [TILE * start + i for i in range(f)]
        size += [f] * f
        start += f
    return torch.tensor(base), torch.tensor(size)


def quantize_input(x: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as the kernel quantizes them: int16 values [M, G, block] (as float), scales [M, G]
    (per block: absmax / 32767, round to nearest even) and float sums of x per 32 [M, K / 32]."""
    g = x.float().reshape(x.shape[0], x.shape[1] // block, block)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
    return torch.round(g * inv[..., None]), amax / 32767, x.float().reshape(x.shape[0], x.shape[1] // GROUP, GROUP).sum(-1)


def _k_linear_ref(x: torch.Tensor, plain: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """quant_linear_ref of a K format (float64): per block the exact integer dot of x's int16 values with the
    scaled integer weights times d dx, less (Q4_K/Q5_K) dmin dx sum_s m_s (sum of x's integers over s)."""
    qw, dw, dmin, mins = _k_ints(plain, fmt)
    qx, dx, _ = quantize_input(x, SUPER)
    dots = torch.einsum("mbi,nbi->mnb", qx.double(), qw.double())
    y = dots * (dw.double()[None] * dx.double()[:, None])
    if dmin is not None:
        xs = qx.double().reshape(*qx.shape[:2], 8, 32).sum(-1)  # [M, B, 8]
        y = y - torch.einsum("mbs,nbs->mnb", xs, mins.double()) * (dmin.double()[None] * dx.double()[:, None])
    return y.sum(-1)


def quant_linear_ref(x: torch.Tensor, tiled: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The kernel's arithmetic, exactly (float64; blocks in the kernel's layout): x quantized per block,
    integer dot products per block, then d_w * d_x (and Q4_1's min_w * sum(x)) per block."""
    if fmt.super_block:
        y = _k_linear_ref(x, deinterleave(tiled, fmt), fmt)
        return (y if bias is None else y + bias.double()).float()
    qw, dw, mw = _weight_ints(deinterleave(tiled, fmt), fmt)
    qx, dx, sx = quantize_input(x)
    dots = torch.einsum("mgi,ngi->mng", qx.double(), qw.double())
    y = (dots * (dw.double()[None] * dx.double()[:, None])).sum(-1)
    if mw is not None:
        y = y + (mw.double()[None] * sx.double()[:, None]).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.float()


def quant_linear(x: torch.Tensor, tiled: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None,
                 exact: bool = True) -> torch.Tensor:
    """x @ dequantize(w).T (+ bias) for a 2-D float32 x with the activations quantized per block, to int16 where
    `exact` (`quant_linear_ref`) else to int8 (`quant_linear_q8_ref`), by the C kernel where it applies (any row
    count; its per-row sums never depend on the batch). `tiled` is `interleave(blocks)`."""
    return QuantMatmul(tiled, fmt, bias, exact)(x)


class QuantMatmul:
    """`quant_linear` for one weight (and bias), checked once here, so a call checks only x: a decode
    step makes a hundred or more of these calls, each a few microseconds of Python. `normed`,
    `add_normed` and `act_mul` fuse the step before the matmul into the kernel's input quantization
    (one call instead of two; the same result as the two). Every call is `invariant` (a row's result the same in
    any batch) unless told otherwise: then K-format calls of many rows may take the faster bfloat16 path."""

    def __init__(self, tiled: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None, exact: bool = True):
        self.tiled, self.fmt, self.bias, self.exact = tiled, fmt, bias, exact
        self.n, self.k = tiled.shape[0], tiled.shape[1] // fmt.block_bytes * fmt.block_size
        lib = _library()
        fits = tiled.is_contiguous() and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous()))
        self._fn = lib.quant_linear if lib is not None and fits else None
        self._w, self._b = tiled.data_ptr(), None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor, invariant: bool = True) -> torch.Tensor:
        if self._fits(x, self.k):
            return self._run(x, AS_IS, None, 0.0, None, invariant)
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x of shape {tuple(x.shape)}: the weight takes [rows, {self.k}] features")
        if self._fn is None or x.dtype is not torch.float32 or not x.is_cpu:
            if self.exact:
                return quant_linear_ref(x, self.tiled, self.fmt, self.bias)
            from plait.kernels.q8_ref import quant_linear_q8_ref

            return quant_linear_q8_ref(x, self.tiled, self.fmt, self.bias)
        return self._run(x.contiguous(), AS_IS, None, 0.0, None, invariant)

    def normed(self, x: torch.Tensor, w: torch.Tensor, eps: float, invariant: bool = True) -> torch.Tensor:
        """self(rms_norm(x, w, eps))."""
        if not self._fits(x, self.k) or not self._fits_norm(w):
            return self(cpu_fused.rms_norm(x, w, eps), invariant)
        return self._run(x, RMS_NORM, w.data_ptr(), eps, None, invariant)

    def add_normed(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, invariant: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, self(rms_norm(x + residual, w, eps))), the sum written into x as cpu_fused.add_rms_norm."""
        if (not self._fits(x, self.k) or not self._fits(residual, self.k) or residual.shape != x.shape
                or not self._fits_norm(w)):
            x, h = cpu_fused.add_rms_norm(x, residual, w, eps)
            return x, self(h, invariant)
        return x, self._run(x, ADD_RMS_NORM, w.data_ptr(), eps, residual.data_ptr(), invariant)

    def act_mul(self, gate_up: torch.Tensor, act: str = "silu", invariant: bool = True) -> torch.Tensor:
        """self(act(gate) * up) for gate_up [M, 2K] = gate | up (act: silu or gelu_tanh)."""
        if not self._fits(gate_up, 2 * self.k):
            return self(cpu_fused.act_mul(gate_up, act), invariant)
        return self._run(gate_up, SILU_MUL if act == "silu" else GELU_MUL, None, 0.0, None, invariant)

    def _fits(self, x: torch.Tensor, cols: int) -> bool:
        return (self._fn is not None and x.dtype is torch.float32 and x.is_cpu and x.dim() == 2
                and x.shape[1] == cols and x.is_contiguous())

    def _fits_norm(self, w: torch.Tensor) -> bool:
        return w.dtype is torch.float32 and w.shape == (self.k,) and w.is_contiguous()

    def _run(self, x: torch.Tensor, prologue: int, norm_w: int | None, eps: float, residual: int | None,
             invariant: bool) -> torch.Tensor:
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        self._fn(x.data_ptr(), self._w, self._b, y.data_ptr(), x.shape[0], self.n, self.k, self.fmt.code, prologue,
                 norm_w, eps, residual, torch.get_num_threads(), int(invariant), int(self.exact))
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
    k = tiled.shape[1] // fmt.block_bytes * fmt.block_size
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    lib.quant_rows(tiled.data_ptr(), ids.data_ptr(), ids.numel(), tiled.shape[0], k, fmt.code, out.data_ptr())
    return out


def bf16_panels() -> bool:
    """Whether the kernel's non-invariant many-row calls take bfloat16 dot products (a build for AVX512-BF16)."""
    lib = _library()
    return lib is not None and bool(lib.quant_bf16_panels())


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_library("quant_linear", quant_linear=(PTR, PTR, PTR, PTR, I64, I64, I64, INT, INT, PTR, F32, PTR, INT, INT,
                                                     INT),
                       quant_rows=(PTR, PTR, I64, I64, I64, INT, PTR), quant_bf16_panels=(),
                       q6k_from_gguf=(PTR, PTR, I64), interleave_tiles=(PTR, I64, I64, I64, PTR, I64),
                       quant_q6k_packed=(), q6k_pack_high=(PTR, I64))
    if lib is not None:
        lib.quant_bf16_panels.restype = ctypes.c_int
        lib.quant_q6k_packed.restype = ctypes.c_int
    return lib


def _packs_high(fmt: BlockFormat) -> bool:
    """Whether whole tiles of `fmt` hold high bits other than as the plain block does (Q6_K where q6k_packed())."""
    return fmt is Q6_K and q6k_packed()


def q6k_packed() -> bool:
    """Whether whole tiles hold Q6_K's high bits packed 2 bits a weight (the kernels built for this CPU level read them
    so: kernels/quant_linear.c, Q6K_PACKED), not as the plain block's two bit planes."""
    lib = _library()
    return lib is not None and bool(lib.quant_q6k_packed())
