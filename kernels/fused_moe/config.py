"""Tile sizes for the Triton MoE GEMM, chosen by shape from JSON files.

A file `configs/E={experts},N={intermediate},device_name={gpu}[,dtype={dtype}].json` maps a token count
M (as a string) to a config {BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps,
num_stages}; the entry for the nearest M is used. `benchmarks/gpu/tune_fused_moe.py` measures candidates
on the GPU at hand and writes these files. With no file for the shape, a default by M.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


def config_file_name(experts: int, intermediate: int, device_name: str, dtype: str | None = None) -> str:
    device = device_name.replace(" ", "_")
    return f"E={experts},N={intermediate},device_name={device}" + (f",dtype={dtype}" if dtype else "") + ".json"


@functools.cache
def _load(name: str) -> dict[int, dict] | None:
    path = CONFIG_DIR / name
    if not path.is_file():
        return None
    return {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}


def default_config(tokens: int) -> dict:
    if tokens <= 32:  # decode: few rows per expert, skinny tiles
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                "num_warps": 4, "num_stages": 3}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8,
            "num_warps": 4, "num_stages": 3}


def get_config(tokens: int, experts: int, intermediate: int, device_name: str | None,
               dtype: str | None = None) -> dict:
    table = None
    if device_name:
        table = _load(config_file_name(experts, intermediate, device_name, dtype)) or \
            _load(config_file_name(experts, intermediate, device_name))
    if not table:
        return default_config(tokens)
    return dict(table[min(table, key=lambda m: abs(m - tokens))])
