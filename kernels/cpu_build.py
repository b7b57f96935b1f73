"""Build and load the small C kernels of the CPU path.

Each source is compiled with the system C compiler on first use, for the machine that runs it
(-march=native), and cached by source, compiler and flags. Where no compiler is found, or
PLAIT_DISABLE_C_KERNELS is set, callers get None and run their torch reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# -fopenmp links libgomp.so.1 by soname: the copy torch already loaded, so kernels share its threads
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


# argument types of the kernels' C signatures
PTR, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def load_library(name: str, **signatures: tuple) -> ctypes.CDLL | None:
    """`kernels/<name>.c` as a loaded library, or None where it cannot be built. Each keyword names
    one of its functions (all return void) with its argument types. Callers cache the result."""
    if os.environ.get("PLAIT_DISABLE_C_KERNELS"):
        return None
    try:
        lib = ctypes.CDLL(str(_build(Path(__file__).with_name(f"{name}.c"))))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        logger.warning("C kernel %s unavailable (%s); using its torch reference", name, e)
        return None
    for fn, argtypes in signatures.items():
        getattr(lib, fn).argtypes = list(argtypes)
        getattr(lib, fn).restype = None
    return lib


def _build(source_path: Path) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found")
    # headers are part of every kernel's build: a change to any of them rebuilds
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    digest = hashlib.sha256(source + " ".join([compiler, *_FLAGS, os.uname().machine]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "plait" / "kernels"
    target = cache / f"{source_path.stem}-{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(source_path), "-o", str(out), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: concurrent builders never see a partial file
    return target
