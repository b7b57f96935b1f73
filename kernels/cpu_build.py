"""Build and load the small C kernels of the CPU path.

Each source is compiled with the system C compiler on first use for the CPU's instruction-set
level (kernels/cpu_isa.py: its flags, never -march=native), and cached by source, compiler
version, level and flags, so a cache made on one CPU is never loaded on another. Where no
compiler is found, the level is `ref`, or PLAIT_DISABLE_C_KERNELS is set, callers get None and
run their torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from plait.kernels import cpu_isa

logger = logging.getLogger(__name__)

# -fopenmp links libgomp.so.1 by soname: the copy torch already loaded, so kernels share its threads
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


# argument types of the kernels' C signatures
PTR, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int



def __getattr__(name: str):
    """FORMATS: the storage formats the kernels' format arguments name (kernels/simd_cvt.h), by torch dtype; built
    on first use, so that asking whether the kernels can run (the server's own process, which holds no model)
    imports no torch."""
    if name != "FORMATS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    return {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def load_library(name: str, **signatures: tuple) -> ctypes.CDLL | None:
    """`kernels/<name>.c` built for the selected ISA level as a loaded library, or None where it
    cannot be built (or the level is `ref`). Each keyword names one of its functions (all return
    void) with its argument types. Callers cache the result."""
    if _disabled():
        _LOADED[name] = "torch"
        return None
    level = cpu_isa.selected()
    try:
        lib = ctypes.CDLL(str(_build(Path(__file__).with_name(f"{name}.c"), level)))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        logger.warning("C kernel %s unavailable (%s); using its torch reference", name, e)
        _LOADED[name] = "torch"
        return None
    for fn, argtypes in signatures.items():
        getattr(lib, fn).argtypes = list(argtypes)
        getattr(lib, fn).restype = None
    _LOADED[name] = f"c/{level}"
    return lib


def c_kernels_possible() -> bool:
    """Whether the C kernels can run here (a compiler, a level other than `ref`, not disabled), without
    building anything."""
    return not _disabled() and _compiler() is not None


def _disabled() -> bool:
    """C kernels turned off: PLAIT_DISABLE_C_KERNELS, or the `ref` level."""
    return bool(os.environ.get("PLAIT_DISABLE_C_KERNELS")) or cpu_isa.selected() == "ref"


# kernel name -> what serves it ("c/<level>" or "torch"), for the start-up log and /server_info
_LOADED: dict[str, str] = {}


def loaded_kernels() -> dict[str, str]:
    """Load every CPU kernel now (a bad PLAIT_CPU_ISA fails here, at start-up) and say what serves
    each: {"cpu_isa": level, kernel: "c/<level>" | "torch"}."""
    from plait.kernels import cpu_attention, cpu_bitmask, cpu_decode, cpu_fused, cpu_linear, cpu_quant

    for module in (cpu_attention, cpu_bitmask, cpu_decode, cpu_fused, cpu_linear, cpu_quant):
        module._library()
    return {"cpu_isa": cpu_isa.selected(), **_LOADED}


def _build(source_path: Path, level: str) -> Path:
    compiler = _compiler()
    if not compiler:
        raise RuntimeError("no C compiler found")
    flags = [*_FLAGS, *cpu_isa.compile_flags(level)]
    # headers, and the sources a kernel includes whole (decode_layers.c), are part of its build: a change to any
    # of them rebuilds
    text = source_path.read_bytes()
    included = [source_path.parent / name.decode() for name in re.findall(rb'#include "(\w+\.c)"', text)]
    source = text + b"".join(f.read_bytes() for f in [*included, *sorted(source_path.parent.glob("*.h"))])
    key = " ".join([compiler, _compiler_version(compiler), level, *flags, os.uname().machine])
    digest = hashlib.sha256(source + key.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "plait" / "kernels"
    target = cache / f"{source_path.stem}-{level}-{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source_path), "-o", str(out), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: concurrent builders never see a partial file
    return target


def check_compiles(source_path: Path, level: str) -> None:
    """Compile `source_path` for `level` without optimizing or linking (a level this CPU lacks cannot be loaded,
    but its build must still compile): an intrinsic outside the level's flags is an error at -O0 as at -O3."""
    compiler = _compiler()
    if not compiler:
        raise RuntimeError("no C compiler found")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([compiler, "-O0", "-fopenmp", "-fPIC", "-c", *cpu_isa.compile_flags(level),
                               str(source_path), "-o", str(Path(tmp) / "check.o")],
                              capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(f"{source_path.name} does not compile for {level}:\n{done.stderr[-4000:]}")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.lru_cache(maxsize=4)
def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "unknown"
