"""A model's tokenizer without the model: what the processes that only tokenize and detokenize load. It imports
no torch (a GGUF's tokenizer comes from its metadata, a folder's from transformers' AutoTokenizer), so those
processes stay ~200 MB smaller."""

from __future__ import annotations

import glob
import os
from typing import Any


def gguf_file_of(model_path: str) -> str | None:
    """The GGUF file a model path names: the file itself (whatever its name: the reader checks its magic), or a
    folder's one .gguf beside no safetensors."""
    if os.path.isfile(model_path):
        return model_path
    if os.path.isdir(model_path):
        ggufs = glob.glob(os.path.join(model_path, "*.gguf"))
        if not glob.glob(os.path.join(model_path, "*.safetensors")) and len(ggufs) == 1:
            return ggufs[0]
    return None


def load_tokenizer(model_path: str, tokenizer_path: str | None = None) -> Any:
    """`tokenizer_path`'s tokenizer if given, else the model's (a GGUF file's own, or the folder's)."""
    gguf = None if tokenizer_path else gguf_file_of(model_path)
    if gguf is not None:
        from plait.runtime.model_loader.gguf_file import GGUFFile
        from plait.runtime.model_loader.gguf_tokenizer import build_tokenizer

        return build_tokenizer(GGUFFile(gguf).metadata)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path or model_path)
