"""A GGUF file read by plait itself: the key-value metadata, the tensor table, and each tensor's bytes
in place (a memory map).

The layout (GGUF v2/v3, little-endian): magic, version, tensor and key counts; the keys, each a
string and a typed value (arrays of any value type, strings among them); the tensor table (name,
dimensions innermost first, ggml type, offset into the data section); the data section, aligned to
`general.alignment`. Type numbers and block sizes come from the `gguf` package (llama.cpp's own
constants), so a type it knows is a type this reader knows; whether plait can serve a type is the
loader's question (runtime/model_loader/sources.py), asked of every tensor before any weight is read.

Numeric arrays become numpy arrays without a per-item Python loop; a string array (a vocabulary
of 262k tokens) is one pass of `struct` reads, ~0.2 s. The header is read through a memory map, tensors with
plain reads.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# GGUF value types: scalars by struct code, then 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A file that is not GGUF, or is cut short or malformed."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # outermost first (torch order): a matrix is (rows, columns)
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


def type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (torch order) stored as `ggml_type`; rows must hold whole blocks."""
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"unknown ggml type {ggml_type}") from None
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[-1] % block:
        raise GGUFError(f"rows of {shape[-1]} values do not hold whole {type_name(ggml_type)} blocks of {block}")
    return count // block * size


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, code: str) -> Any:
        size = struct.calcsize(code)
        if self.pos + size > len(self.buf):
            raise GGUFError("file ends inside its header")
        (value,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError("file ends inside a string of its header")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFError("file ends inside an array of its header")
                arr = np.frombuffer(self.buf[self.pos : end], dtype=dtype).copy()
                self.pos = end
                return arr
            if item == _STRING:
                return self._strings(count)
            return [self.value(item) for _ in range(count)]
        raise GGUFError(f"unknown GGUF value type {vtype}")

    def _strings(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        unpack, total = struct.unpack_from, len(buf)
        for _ in range(count):
            if pos + 8 > total:
                raise GGUFError("file ends inside a string array of its header")
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            out.append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
            pos += n
        if pos > total:
            raise GGUFError("file ends inside a string array of its header")
        self.pos = pos
        return out


class GGUFFile:
    """The metadata (`metadata[key]`: ints, floats, strings, numpy arrays, lists of strings) and
    tensor table (`tensors`, in file order) of a GGUF file; `data(info)` is a tensor's bytes."""

    def __init__(self, path: str):
        self.path = path
        mapped = np.memmap(path, dtype=np.uint8, mode="r")  # the header only: dropped once it is parsed
        buf = memoryview(mapped)
        if bytes(buf[:4]) != _MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf)
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors, n_keys = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_keys):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            raw.append((name, cur.scalar("<I"), tuple(reversed(dims)), cur.scalar("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = (cur.pos + align - 1) // align * align
        self.tensors: list[TensorInfo] = []
        for name, ggml_type, shape, offset in raw:
            nbytes = tensor_nbytes(ggml_type, shape)
            start = self.data_start + offset
            if start + nbytes > len(mapped):
                raise GGUFError(f"{path}: tensor {name} ({type_name(ggml_type)}, {list(shape)}) runs past the end "
                                "of the file (a truncated download, or parts joined out of order?)")
            self.tensors.append(TensorInfo(name, ggml_type, shape, start, nbytes))

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def data(self, info: TensorInfo) -> np.ndarray:
        """A copy of the tensor's bytes, read from the file (not through the memory map: mapped pages would count
        in the process's resident memory until the map is closed, a whole model's worth by the end of a load)."""
        out = np.empty(info.nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(info.offset)
            if f.readinto(memoryview(out)) != info.nbytes:
                raise GGUFError(f"{self.path}: tensor {info.name} is cut short")
        return out
