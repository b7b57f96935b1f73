"""plait: prompt programs on a fast serving runtime. `import plait as pl`."""

from typing import Any

__version__ = "0.1.0"
_RUNTIME = {"Engine": "plait.runtime.entrypoints.engine", "ServerArgs": "plait.runtime.server_args"}


def __getattr__(name: str) -> Any:
    # lazy, so the runtime's helper processes (and `plait --help`) do not import torch or the DSL for nothing
    import importlib

    if name in _RUNTIME:
        return getattr(importlib.import_module(_RUNTIME[name]), name)
    lang = importlib.import_module("plait.lang")
    if name in lang.__all__:
        return getattr(lang, name)
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


def __dir__() -> list[str]:
    import plait.lang

    return sorted([*_RUNTIME, *plait.lang.__all__, "__version__"])
