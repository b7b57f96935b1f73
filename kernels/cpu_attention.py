"""Paged decode attention on CPU: a small C kernel (compiled with the system C compiler on first
use, cached per source and machine) beside its plain-torch reference with the same signature.

The reference gathers every request's keys into a padded copy before attending; at 64 requests
x 300 tokens that copy moves ~1 GB per decode step and takes most of it. The kernel reads keys in
place through the slot table. Where no compiler is found, the reference runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.c")
# compiled on the machine that runs it, so -march=native is the right target
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC"]
_MIN_ROWS_PER_THREAD = 16384


def paged_decode_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               slots: torch.Tensor, lens: torch.Tensor, scale: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, G, D] (G query heads per kv head); k_pool [S, H, D], v_pool [S, H, Dv];
    slots [B, L] (request b's keys are slots[b, :lens[b]]). Returns out [B, H, G, Dv] and the
    log-sum-exp of each query's scores [B, H, G]."""
    batch, length = slots.shape
    k, v = gather_kv(k_pool, v_pool, slots)
    mask = torch.zeros(batch, 1, 1, length, dtype=q.dtype)
    mask.masked_fill_((torch.arange(length)[None, :] >= lens[:, None]).view(batch, 1, 1, length), float("-inf"))
    return attention_with_lse(q, k, v, mask, scale)


def gather_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of slots [B, L] as [B, H, L, D] (index_select on a flat index: much faster than 2-D indexing)."""
    batch, length = slots.shape
    flat = slots.reshape(-1)
    k = k_pool.index_select(0, flat).view(batch, length, *k_pool.shape[1:]).transpose(1, 2)
    v = v_pool.index_select(0, flat).view(batch, length, *v_pool.shape[1:]).transpose(1, 2)
    return k, v


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA that also returns the log-sum-exp of each query's scores (to merge partial attentions)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                      scale=scale)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           slots: torch.Tensor, lens: torch.Tensor, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as paged_decode_attention_ref; the C kernel where it applies."""
    lib = _library()
    if (lib is None or q.device.type != "cpu" or q.dtype != torch.float32 or k_pool.dtype != torch.float32
            or k_pool.stride(-1) != 1 or k_pool.stride(1) != k_pool.shape[2]
            or v_pool.stride(-1) != 1 or v_pool.stride(1) != v_pool.shape[2]):
        return paged_decode_attention_ref(q, k_pool, v_pool, slots, lens, scale)
    q = q.contiguous()
    slots = slots.contiguous()
    lens = lens.contiguous()
    batch, heads, groups, dim = q.shape
    vdim = v_pool.shape[2]
    # a second thread pays off only for enough work: spawning one costs tens of microseconds, and it
    # competes with torch's OpenMP workers, which spin for a while after each op
    threads = torch.get_num_threads() if batch * heads * slots.shape[1] >= _MIN_ROWS_PER_THREAD else 1
    out = torch.empty(batch, heads, groups, vdim, dtype=q.dtype)
    lse = torch.empty(batch, heads, groups, dtype=q.dtype)
    lib.paged_decode_attention(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), lens.data_ptr(), out.data_ptr(),
        lse.data_ptr(), batch, heads, groups, dim, vdim, slots.shape[1], k_pool.stride(0), v_pool.stride(0),
        scale, threads,
    )
    return out, lse


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("PLAIT_DISABLE_C_KERNELS"):
        return None
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        logger.warning("C attention kernel unavailable (%s); using the torch reference", e)
        return None
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.paged_decode_attention.argtypes = [p] * 7 + [i64] * 8 + [f32, ctypes.c_int]
    lib.paged_decode_attention.restype = None
    return lib


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found")
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join([compiler, *_FLAGS, os.uname().machine]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "plait" / "kernels"
    target = cache / f"paged_decode-{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(out), "-lpthread", "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: concurrent builders never see a partial file
    return target
