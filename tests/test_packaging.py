"""The wheel carries the whole package: every sub-package of the source tree and every kernel source
(the C kernels are compiled from their sources on the user's machine)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> its package name (pyproject's package-dir)
PACKAGE_DIRS = {"plait": "plait", "lang": "plait/lang", "runtime": "plait/runtime", "radix_cache": "plait/radix_cache",
                "kernels": "plait/kernels"}


def test_wheel_holds_every_subpackage_and_kernel_source(tmp_path):
    # build from a copy: setuptools leaves a build/ folder beside the sources, whose stale files a later
    # wheel would pick up
    src = tmp_path / "src"
    for name in (*PACKAGE_DIRS, "pyproject.toml", "README.md"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__", "work")}
                                          if copy is shutil.copytree else {}))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("plait-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for src, pkg in PACKAGE_DIRS.items():
        for init in (ROOT / src).rglob("__init__.py"):
            expected.add(f"{pkg}/{init.parent.relative_to(ROOT / src).as_posix()}/__init__.py".replace("/./", "/"))
        for source in (ROOT / src).rglob("*"):
            if source.suffix in (".c", ".h", ".py") and "__pycache__" not in source.parts:
                expected.add(f"{pkg}/{source.relative_to(ROOT / src).as_posix()}")
    # the EAGLE-3 head shipped for the default model (its training work dir is not part of it)
    heads = [f for f in (ROOT / "plait" / "heads").glob("*/*") if f.suffix in (".json", ".safetensors")]
    expected |= {f"plait/{f.relative_to(ROOT / 'plait').as_posix()}" for f in heads}
    assert "plait/heads/SmolLM2-135M-Instruct-EAGLE3/model.safetensors" in expected
    assert "plait/runtime/entrypoints/__init__.py" in expected and "plait/kernels/skinny_linear.c" in expected
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel: {missing}"
