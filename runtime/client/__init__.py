"""The runtime client (tokenize, send, gather, stream, data-parallel routing, results shaped as SGLang's) and
its metrics: what the HTTP server and the Engine share. Names import on first use."""

from plait.runtime.lazy import lazy_exports

_NAMES = {"RuntimeClient": "runtime_client", "GenerateInput": "request", "ReqState": "request",
          "QueueFull": "request", "RequestFailed": "request", "RuntimeDead": "request", "EmbedInput": "embeddings"}
__getattr__ = lazy_exports(__name__, _NAMES)
__all__ = list(_NAMES)
