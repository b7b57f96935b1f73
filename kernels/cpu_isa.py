"""The CPU's instruction-set level, detected once, which the C kernels are built for.

Levels, each a superset of the one before: `ref` (no C kernels: the torch references), `avx2`
(AVX2 + FMA + F16C), `avx512` (+ AVX-512 F/BW/VL/DQ), `avx512_vnni` (+ VNNI int8 dot products),
`avx512_bf16` (+ AVX-512 BF16), `amx` (+ AMX tiles with bfloat16 products).
A kernel is compiled with exactly its level's flags (never -march=native), and the level and
flags are part of its cache key, so a kernel built on one CPU is never loaded on another that
lacks its instructions. `PLAIT_CPU_ISA=ref|avx2|avx512|avx512_vnni|avx512_bf16|amx` forces a level (an error
where the CPU lacks it). Non-x86 machines get `generic`: portable C, the kernels' scalar paths.
"""

from __future__ import annotations

import functools
import os
import platform

LEVELS = ("ref", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_NEEDS = {"ref": frozenset(), "avx2": _AVX2, "avx512": _AVX512, "avx512_vnni": _AVX512 | {"avx512_vnni"},
          "avx512_bf16": _AVX512 | {"avx512_bf16", "avx512_vnni"},
          "amx": _AVX512 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}}
_FLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512_vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512vnni"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-mavx512vnni"],
    "amx": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
            "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_levels(flags: frozenset[str] | None = None) -> list[str]:
    """Every level this CPU can run, lowest first."""
    if not _is_x86():
        return ["ref", "generic"]
    flags = cpu_flags() if flags is None else flags
    return [lvl for lvl in LEVELS if _NEEDS[lvl] <= flags]


def detect(flags: frozenset[str] | None = None) -> str:
    """The best level the CPU has."""
    return supported_levels(flags)[-1]


@functools.lru_cache(maxsize=1)
def selected() -> str:
    """The level the kernels are built for: PLAIT_CPU_ISA if set (checked against the CPU), else the
    best one present."""
    forced = os.environ.get("PLAIT_CPU_ISA")
    if not forced:
        return detect()
    return check_level(forced)


def check_level(level: str) -> str:
    levels = supported_levels()
    if level not in (*LEVELS, "generic"):
        raise ValueError(f"PLAIT_CPU_ISA must be one of {list(LEVELS)}, got {level!r}")
    if level not in levels:
        missing = sorted(_NEEDS.get(level, frozenset()) - cpu_flags())
        raise ValueError(f"PLAIT_CPU_ISA={level}: this CPU lacks {', '.join(missing) or 'that level'} "
                         f"(it supports {', '.join(levels)})")
    return level


def native_bf16(level: str | None = None) -> bool:
    """Whether `level` (default: the selected one) has bfloat16 dot products."""
    return (selected() if level is None else level) in ("avx512_bf16", "amx")


def compile_flags(level: str) -> list[str]:
    """The compiler flags that target exactly `level` (no flags for `ref`: nothing is built)."""
    return list(_FLAGS.get(level, []))


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
