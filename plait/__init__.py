"""plait: prompt programs on a fast serving runtime. `import plait as pl`."""

from typing import Any

__all__ = ["Engine", "ServerArgs"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # lazy, so the runtime's helper processes (and `plait --help`) do not import torch for nothing
    if name == "Engine":
        from plait.runtime.engine import Engine

        return Engine
    if name == "ServerArgs":
        from plait.runtime.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
