"""A model's tokenizer (and config) without the model: what the processes that only tokenize, detokenize or compile
grammars load. It imports no torch (a GGUF's tokenizer comes from its metadata, a folder's from transformers' AutoTokenizer), so those
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


def load_tokenizer(model_path: str, tokenizer_path: str | None = None, header: Any = None) -> Any:
    """`tokenizer_path`'s tokenizer if given, else the model's (a GGUF file's own, or the folder's); `header`: the
    GGUF file already parsed (a GGUFFile)."""
    gguf = None if tokenizer_path else gguf_file_of(model_path)
    if gguf is not None:
        from plait.runtime.model_loader.gguf_file import GGUFFile
        from plait.runtime.model_loader.gguf_tokenizer import build_tokenizer

        return build_tokenizer((header or GGUFFile(gguf)).metadata)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path or model_path)


def end_ids(config: Any, tokenizer: Any) -> list[int]:
    """The ids that end a sequence: the model config's (a ModelConfig) and the tokenizer's own (None: no tokenizer)."""
    ids = set(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def grammar_vocab(model_path: str, tokenizer_path: str | None = None) -> tuple[Any, int, list[int]]:
    """(tokenizer, vocabulary size, end ids): what a grammar backend is built from, as the scheduler has them
    once its model loaded, read from the header alone (a compile worker builds its backend from these)."""
    gguf = gguf_file_of(model_path)
    if gguf is not None:
        from plait.runtime.model_loader.gguf_arch import config_from_gguf
        from plait.runtime.model_loader.gguf_file import GGUFFile

        header = GGUFFile(gguf)
        config = config_from_gguf(header)
    else:
        from transformers import AutoConfig

        from plait.runtime.model_config import ModelConfig

        header, config = None, ModelConfig.from_hf(AutoConfig.from_pretrained(model_path))
    tokenizer = load_tokenizer(model_path, tokenizer_path, header)
    return tokenizer, config.vocab_size, end_ids(config, tokenizer)
