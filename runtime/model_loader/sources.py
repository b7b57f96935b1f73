"""Weight sources: a GGUF file or a HuggingFace folder, each giving a transformers config, a
tokenizer, and a stream of (HF tensor name, tensor) pairs in HF layout."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import torch

from plait.kernels.cpu_quant import BY_GGML_TYPE, BlockFormat, BlockTensor, dequantize, from_gguf
from plait.runtime.model_config import ModelConfig
from plait.runtime.model_loader.gguf_arch import (ROPE_TENSORS, config_from_gguf, hf_name, needs_unpermute,
                                                  norm_shift, unpermute_qk)
from plait.runtime.model_loader.gguf_file import GGUFFile, TensorInfo
from plait.runtime.model_loader.gguf_tokenizer import build_tokenizer
from plait.runtime.model_loader.tokenizer import gguf_file_of

def _served_format(info: TensorInfo) -> BlockFormat | None:
    """The block format plait keeps a GGUF tensor in as stored (matrices in a format the kernels take), else None."""
    return BY_GGML_TYPE.get(info.ggml_type) if len(info.shape) == 2 else None


_FLOATS = {0: np.float32, 1: np.float16}  # F32, F16 (BF16, type 30, is widened by hand)


def _bounded_map(fn, items: list, workers: int) -> Iterator:
    """fn over items in order on a thread pool, at most 2 * workers results ahead of the consumer (Executor.map
    runs them all at once: every tensor of a model in memory beside the model itself)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending = deque(pool.submit(fn, item) for item in items[: 2 * workers])
        for item in items[2 * workers :]:
            yield pending.popleft().result()
            pending.append(pool.submit(fn, item))
        while pending:
            yield pending.popleft().result()


def _readable(ggml_type: int) -> bool:
    """Whether a tensor of this type can be read: a float, a block format the kernels take, or one the `gguf`
    package dequantizes."""
    import gguf
    from gguf.quants import _type_traits

    if ggml_type in _FLOATS or ggml_type == 30 or ggml_type in BY_GGML_TYPE:
        return True
    try:
        return gguf.GGMLQuantizationType(ggml_type) in _type_traits
    except ValueError:
        return False


def float_tensor(raw, info: TensorInfo) -> torch.Tensor:
    """A GGUF tensor's bytes as float32 in its (HF-order) shape: floats widened, anything else dequantized."""
    import gguf

    if info.ggml_type in _FLOATS:
        t = torch.from_numpy(np.frombuffer(raw, dtype=_FLOATS[info.ggml_type]).astype(np.float32))
    elif info.ggml_type == 30:  # BF16: widen the raw 16 bits
        t = torch.from_numpy((np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32))
    elif len(info.shape) == 2 and info.ggml_type in BY_GGML_TYPE:  # plait's own dequantization: 5-10x faster
        blocks = from_gguf(torch.from_numpy(raw).view(info.shape[0], -1), info.ggml_type)
        t = dequantize(blocks, BY_GGML_TYPE[info.ggml_type])
    else:
        t = torch.from_numpy(gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(info.ggml_type)))
    return t.reshape(info.shape).contiguous()


class GGUFSource:
    """A GGUF file, read by plait's own reader (runtime/model_loader/gguf_file.py): the config from its
    metadata, the tokenizer from its vocabulary, tensors renamed and laid out as HF's. A tensor of a type
    that cannot be read fails here, before anything loads, naming the tensor and the type."""

    def __init__(self, path: str):
        self.file = GGUFFile(path)
        self.path = path
        self.arch = self.file.architecture
        unreadable = [t for t in self.file.tensors if not _readable(t.ggml_type)]
        if unreadable:
            t = unreadable[0]
            raise ValueError(f"{path}: tensor {t.name} is stored as {t.type_name} (ggml type {t.ggml_type}), which "
                             f"plait cannot read ({len(unreadable)} such tensors)")
        self.weights = [t for t in self.file.tensors if t.name not in ROPE_TENSORS]
        self._config = config_from_gguf(self.file)

    def model_config(self) -> ModelConfig:
        return self._config

    def tokenizer(self) -> Any:
        return build_tokenizer(self.file.metadata)

    def block_formats(self) -> dict[str, BlockFormat | None]:
        """HF tensor name -> the block format plait serves it in as stored, None for other types."""
        return {hf_name(self.arch, t.name): _served_format(t) for t in self.weights}

    def tensors(self, keep_blocks: bool = False, names: set[str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
        """(HF name, tensor) in HF layout (only `names`, when given); with `keep_blocks`, tensors of a served
        block format come as their blocks (BlockTensor), never widened."""
        cfg = self._config

        def load(info: TensorInfo) -> tuple[str, torch.Tensor | BlockTensor]:
            raw = self.file.data(info)
            name = hf_name(self.arch, info.name)
            fmt = _served_format(info) if keep_blocks else None
            if fmt is not None:  # the blocks as stored, one row of them per weight row
                t = torch.from_numpy(raw).view(info.shape[0], -1)
            else:
                t = float_tensor(raw, info)
                shift = norm_shift(self.arch, name)
                if shift:
                    t = t + shift
            if needs_unpermute(self.arch, name):
                t = unpermute_qk(t, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)  # rows, blocks or floats
            if fmt is not None:
                return name, BlockTensor(from_gguf(t.contiguous(), info.ggml_type), fmt, tuple(info.shape))
            return name, t

        # numpy releases the GIL in dequantization: a small pool overlaps tensors
        wanted = [t for t in self.weights if names is None or hf_name(self.arch, t.name) in names]
        yield from _bounded_map(load, wanted, workers=2)

    def num_tensors(self) -> int:
        return len(self.weights)


class HFSource:
    """A HuggingFace model folder: config.json, tokenizer files, *.safetensors (sharded or not)."""

    def __init__(self, path: str):
        self.path = path
        self.files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):  # only the shards the index names (folders may hold extras)
            with open(index) as f:
                named = set(json.load(f)["weight_map"].values())
            self.files = [p for p in self.files if os.path.basename(p) in named]

    def model_config(self) -> ModelConfig:
        from transformers import AutoConfig

        return sentence_transformers_config(self.path, ModelConfig.from_hf(AutoConfig.from_pretrained(self.path)))

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def block_formats(self) -> dict[str, BlockFormat | None]:
        return {}  # float checkpoints

    def tensors(self, keep_blocks: bool = False, names: set[str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor), only `names` when given; `keep_blocks` is moot: a float checkpoint has no blocks."""
        from safetensors import safe_open

        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if names is None or name in names:
                        yield name, f.get_tensor(name)

    def num_tensors(self) -> int:
        from safetensors import safe_open

        total = 0
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                total += len(list(f.keys()))
        return total


# sentence-transformers' pooling modes -> plait's (runtime/model_config.py POOLINGS)
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


def sentence_transformers_config(path: str, config: ModelConfig) -> ModelConfig:
    """`config` with what a sentence-transformers folder adds: its pooling (1_Pooling/config.json) and the
    sequence length it was trained to (sentence_bert_config.json's max_seq_length, which it truncates to)."""
    def read(name: str) -> dict:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return {}
        with open(file) as f:
            return json.load(f)

    changes: dict[str, Any] = {}
    pooling = [mode for key, mode in _ST_POOLING.items() if read(os.path.join("1_Pooling", "config.json")).get(key)]
    if len(pooling) == 1:
        changes["pooling"] = pooling[0]
    elif pooling:
        raise ValueError(f"{path}: a pooling of several modes ({pooling}) is not supported")
    max_len = read("sentence_bert_config.json").get("max_seq_length")
    if isinstance(max_len, int) and 0 < max_len < config.context_length:
        changes["context_length"] = max_len
    return dataclasses.replace(config, **changes) if changes else config


def open_source(model_path: str) -> GGUFSource | HFSource:
    gguf = gguf_file_of(model_path)
    if gguf is not None:
        return GGUFSource(gguf)
    if os.path.isdir(model_path):
        return HFSource(model_path)
    raise FileNotFoundError(f"model_path {model_path!r} is neither a .gguf file nor a model folder")
