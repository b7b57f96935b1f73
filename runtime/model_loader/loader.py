"""Load a model: its config, weights streamed from GGUF or safetensors into the runtime layout, and (beside them,
on a thread) its tokenizer."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from plait.runtime.distributed.group import SINGLE, Group
from plait.runtime.layers.linear import VocabEmbedding
from plait.runtime.layers.quantization import QuantConfig
from plait.runtime.model_config import ModelConfig
from plait.runtime.model_loader.sources import GGUFSource, HFSource, open_source
from plait.runtime.model_loader.tokenizer import load_tokenizer
from plait.runtime.models import LlamaForCausalLM, model_class

logger = logging.getLogger(__name__)

# tensors some checkpoints carry that the runtime recomputes or does not use (an encoder's position ids buffer,
# and its pooler: sentence embeddings pool the hidden states themselves)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any


def load_model(model_path: str, dtype: torch.dtype, max_positions: int | None = None,
               tokenizer_path: str | None = None, progress: bool = True, with_tokenizer: bool = True,
               quantization: str = "none", packed: bool = True, group: Group = SINGLE,
               matmul: str = "exact") -> LoadedModel:
    """The model (this rank's shard of it under tensor or expert parallelism), its config and tokenizer."""
    start = time.perf_counter()
    source = open_source(model_path)
    config = source.model_config()
    with ThreadPoolExecutor(max_workers=1) as pool:
        # the tokenizer builds (Python-bound) while weights dequantize (numpy, off the GIL)
        tokenizer_future = pool.submit(_source_tokenizer, source, tokenizer_path) if with_tokenizer else None
        quant = QuantConfig(quantization, dtype, packed, source.block_formats(), matmul)
        model = model_class(config)(config, quant, max_positions or config.context_length, group=group)
        load_weights(model, source, progress, keep_blocks=quant.wants_blocks)
        model.eval()
        tokenizer = tokenizer_future.result() if tokenizer_future else None
    logger.info("loaded %s (%s, %s, weights %s) in %.2f s", model_path, config.model_type, dtype,
                "+".join(model.weight_formats()), time.perf_counter() - start)
    return LoadedModel(model, config, tokenizer)


@dataclass
class VocabLayers:
    """A model's token embedding and LM head (the same layer when tied)."""

    embed: VocabEmbedding
    lm_head: VocabEmbedding


def load_vocab_layers(model_path: str, dtype: torch.dtype, quantization: str = "none",
                      packed: bool = True, matmul: str = "exact") -> VocabLayers:
    """The embedding and LM head whole, on one rank: what an EAGLE head beside a target split across ranks
    reads (the target's own are split by vocabulary, and the head runs on rank 0 alone)."""
    source = open_source(model_path)
    config = source.model_config()
    quant = QuantConfig(quantization, dtype, packed, source.block_formats(), matmul)
    names = ["model.embed_tokens.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])
    layers = [VocabEmbedding(config.vocab_size, config.hidden_size, quant.method([n], embedding=True)) for n in names]
    loaders = dict(zip(names, layers))
    for name, tensor in source.tensors(quant.wants_blocks, set(names)):
        loaders.pop(name).weight_loader(tensor)
    if loaders:
        raise ValueError(f"{model_path}: missing {sorted(loaders)}")
    for layer in layers:
        layer.finish_loading()
    return VocabLayers(layers[0], layers[-1])


def _source_tokenizer(source: GGUFSource | HFSource, tokenizer_path: str | None) -> Any:
    return load_tokenizer(source.path, tokenizer_path) if tokenizer_path else source.tokenizer()


def load_weights(model: LlamaForCausalLM, source: GGUFSource | HFSource, progress: bool = True,
                 keep_blocks: bool = False) -> None:
    """Hand every tensor of the source to its layer's loader, then let the layers build their matmul
    copies; reject missing, leftover and misshapen tensors. With `keep_blocks`, GGUF tensors in a
    block format plait serves come as their blocks (runtime/layers/quantization.py)."""
    loaders = model.weight_loaders()
    filled: dict[str, bool] = {name: False for name in loaders}
    leftovers: list[str] = []
    total = source.num_tensors()
    for name, tensor in tqdm(source.tensors(keep_blocks), total=total, desc="loading weights", disable=not progress, leave=False):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings and name not in loaders:
            continue  # tied checkpoints may still store a copy
        if name not in loaders:
            leftovers.append(name)
            continue
        if filled[name]:
            raise ValueError(f"tensor {name} appears twice in the checkpoint")
        try:
            loaders[name](tensor)
        except ValueError as e:
            raise ValueError(f"tensor {name}: {e}") from None
        filled[name] = True
    missing = [n for n, ok in filled.items() if not ok]
    if missing or leftovers:
        raise ValueError(f"weights do not match the model: missing {missing[:8]} leftover {leftovers[:8]}"
                         f" ({len(missing)} missing, {len(leftovers)} leftover)")
    model.finish_loading()
