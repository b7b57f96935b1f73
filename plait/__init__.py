"""plait: prompt programs on a fast serving runtime. `import plait as pl`."""

from plait.runtime.engine import Engine
from plait.runtime.server_args import ServerArgs

__all__ = ["Engine", "ServerArgs"]
__version__ = "0.1.0"
