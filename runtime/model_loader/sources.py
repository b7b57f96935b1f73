"""Weight sources: a GGUF file or a HuggingFace folder, each giving a transformers config, a
tokenizer, and a stream of (HF tensor name, tensor) pairs in HF layout."""

from __future__ import annotations

import glob
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import torch

from plait.kernels.cpu_quant import BY_GGML_TYPE, BlockFormat, BlockTensor, from_gguf
from plait.runtime.model_config import ModelConfig

# GGUF tensor names -> HF names for the Llama family ({i} is the layer index)
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's converter permutes Q/K rows (interleaved rotary) for these architectures only
_GGUF_PERMUTED_ARCHS = {"llama", "mistral"}


def gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return name  # unknown: the strict loader reports it as a leftover tensor


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation (rows interleaved per head) back to HF layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _served_format(info) -> BlockFormat | None:
    """The block format plait keeps a GGUF tensor in as stored (matrices of Q8_0/Q4_0/Q4_1), else None."""
    return BY_GGML_TYPE.get(info.ggml_type) if len(info.shape) == 2 else None


class GGUFSource:
    """A GGUF file. Metadata comes from transformers' fast GGUF reader; tensors are dequantized
    with the `gguf` package (its own GGUFReader parses every vocabulary string as a numpy view,
    about 4 s for this model, so the tensor table is read with transformers' reader instead)."""

    def __init__(self, path: str):
        from transformers.integrations.gguf import GgufHeader, read_gguf_metadata

        self.path = path
        self.metadata, self.tensor_names = read_gguf_metadata(path)
        self.header = GgufHeader.from_file(path)
        self.arch = self.metadata["general.architecture"]

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_gguf(self.metadata, self.tensor_names)

    def tokenizer(self) -> Any:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(self.path)
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)

    def block_formats(self) -> dict[str, BlockFormat | None]:
        """HF tensor name -> the block format plait serves it in as stored, None for other types."""
        return {gguf_to_hf_name(t.name): _served_format(t) for t in self.header.tensors}

    def tensors(self, keep_blocks: bool = False, names: set[str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
        """(HF name, tensor) in HF layout (only `names`, when given); with `keep_blocks`, tensors of a served
        block format come as their blocks (BlockTensor), never widened."""
        import gguf

        cfg_heads = (
            self.metadata.get(f"{self.arch}.attention.head_count"),
            self.metadata.get(f"{self.arch}.attention.head_count_kv"),
        )
        blob = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self.header.data_start
        float_types = {0: np.float32, 1: np.float16}

        def load(info) -> tuple[str, torch.Tensor | BlockTensor]:
            raw = blob[start + info.offset : start + info.offset + info.nbytes]
            name = gguf_to_hf_name(info.name)
            fmt = _served_format(info) if keep_blocks else None
            if fmt is not None:  # the blocks as stored, one row of them per weight row
                t = torch.from_numpy(np.array(raw)).view(info.shape[0], -1)
            elif info.ggml_type in float_types:
                t = torch.from_numpy(np.frombuffer(raw, dtype=float_types[info.ggml_type]).astype(np.float32))
            elif info.ggml_type == 30:  # BF16: widen the raw 16 bits
                t = torch.from_numpy((np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32))
            else:
                t = torch.from_numpy(gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(info.ggml_type)))
            if fmt is None:
                t = t.reshape(info.shape).contiguous()
            if self.arch in _GGUF_PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
                t = unpermute_qk(t, cfg_heads[0] if "q_proj" in name else cfg_heads[1])  # rows, blocks or floats
            if fmt is not None:
                return name, BlockTensor(from_gguf(t.contiguous(), info.ggml_type), fmt, tuple(info.shape))
            return name, t

        # numpy releases the GIL in dequantization: a small pool overlaps tensors
        wanted = [t for t in self.header.tensors if names is None or gguf_to_hf_name(t.name) in names]
        with ThreadPoolExecutor(max_workers=2) as pool:
            yield from pool.map(load, wanted)

    def num_tensors(self) -> int:
        return len(self.header.tensors)


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

        return ModelConfig.from_hf(AutoConfig.from_pretrained(self.path))

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


def open_source(model_path: str) -> GGUFSource | HFSource:
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return GGUFSource(model_path)
    if os.path.isdir(model_path):
        ggufs = glob.glob(os.path.join(model_path, "*.gguf"))
        if not glob.glob(os.path.join(model_path, "*.safetensors")) and len(ggufs) == 1:
            return GGUFSource(ggufs[0])
        return HFSource(model_path)
    raise FileNotFoundError(f"model_path {model_path!r} is neither a .gguf file nor a model folder")
