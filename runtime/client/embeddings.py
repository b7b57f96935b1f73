"""Embedding requests on the client side: the validated input of one embeddings call, its messages, and the
vectors as callers get them (L2-normalized, shortened to `dimensions` first where asked)."""

from __future__ import annotations

import base64
import math
import os
import struct
import uuid
from dataclasses import dataclass

from plait.runtime.ipc.limits import RuntimeLimits, check_json_value
from plait.runtime.ipc.messages import EmbedSpec, TokenizedGenerateReq
from plait.runtime.model_config import POOLINGS
from plait.runtime.sampling import SamplingParams

MAX_INPUTS = 2048  # inputs one call may embed (OpenAI's limit)


@dataclass(frozen=True)
class EmbedInput:
    """One call's inputs (texts, or token id lists), validated; `truncate`: inputs longer than the context are
    cut to it instead of refused (Ollama's default)."""

    texts: list[str] | None
    ids: list[list[int]] | None
    dimensions: int | None = None
    truncate: bool = False
    pooling: str = ""
    encoder: bool = False  # embedded by the server's --embedding-model, not its main model

    @classmethod
    def of(cls, value, limits: RuntimeLimits, field: str = "input", dimensions=None, truncate: bool = False,
           pooling: str | None = None, encoder: bool = False) -> "EmbedInput":
        """`value`: a string, a list of strings, a list of token ids, or a list of such lists (ValueError names
        what is wrong); `limits`: the embedding model's."""
        check_json_value(value, field)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ValueError(f"{field} must be a string, a list of strings, a list of token ids or a list of "
                             "lists of token ids, and not empty")
        if len(value) > MAX_INPUTS:
            raise ValueError(f"{field} has {len(value)} items; at most {MAX_INPUTS} may be embedded at once")
        texts = ids = None
        if all(isinstance(v, str) for v in value):
            texts = value
        elif all(_is_id(v) for v in value):
            ids = [value]
        elif all(isinstance(v, list) and v and all(_is_id(t) for t in v) for v in value):
            ids = value
        else:
            raise ValueError(f"{field} must be a string, a list of strings, a list of token ids or a list of "
                             "non-empty lists of token ids (one kind throughout)")
        if dimensions is not None:
            if not _is_id(dimensions) or not 1 <= dimensions <= limits.embedding_dim:
                raise ValueError(f"dimensions must be an integer in [1, {limits.embedding_dim}]")
            if dimensions < limits.embedding_dim and not limits.matryoshka:
                raise ValueError(f"this model's embeddings have {limits.embedding_dim} dimensions and it was not "
                                 "trained for shorter ones (Matryoshka): dimensions must be "
                                 f"{limits.embedding_dim} or left out")
        if not isinstance(truncate, bool):
            raise ValueError(f"truncate must be a boolean, got {truncate!r}")
        if pooling is not None and pooling not in ("", *POOLINGS):
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
        return cls(texts, ids, dimensions, truncate, pooling or "", encoder)

    def messages(self, tokenize, context_length: int) -> list[TokenizedGenerateReq]:
        """One message per input; `tokenize(text, truncate_to)` gives a text's ids (cut to `truncate_to` tokens
        when that is not None)."""
        cut = context_length if self.truncate else None
        ids_list = ([tokenize(t, cut) for t in self.texts] if self.texts is not None
                    else [x[:cut] if cut else x for x in self.ids])
        params = SamplingParams(max_new_tokens=0)
        spec = EmbedSpec(self.pooling, self.encoder)
        for i, x in enumerate(ids_list):
            if not x:
                raise ValueError(f"input[{i}] is empty: it has no tokens")
        return [TokenizedGenerateReq(uuid.uuid4().hex, list(x), params, embed=spec) for x in ids_list]


def uses_encoder(model: str | None, encoder_names: set[str], main_names: set[str]) -> bool:
    """Which model embeds a request naming `model`: the --embedding-model (True; also when none is named and
    there is one) or the main model (False). LookupError: neither is called that."""
    if model is None:
        return bool(encoder_names)
    if model in encoder_names:
        return True
    if model in main_names:
        return False
    raise LookupError(model)


def encoder_names(embedding_model_path: str | None, given: str | None = None) -> set[str]:
    """The names a request may give the --embedding-model: its folder's name and path, and the name it was
    given by (a packaged model's)."""
    if not embedding_model_path:
        return set()
    return {os.path.basename(embedding_model_path.rstrip("/")), embedding_model_path} | ({given} if given else set())


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def finish_vector(vector: list[float], dimensions: int | None = None) -> list[float]:
    """The pooled state as callers get it: its first `dimensions` values (Matryoshka), L2-normalized."""
    v = vector[:dimensions] if dimensions else vector
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v] if norm > 0 else list(v)


def base64_floats(vector: list[float]) -> str:
    """OpenAI's encoding_format "base64": the little-endian float32 values, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def native_result(value, vectors: list[list[float]], tokens: list[int]) -> dict | list[dict]:
    """SGLang's /encode result: {"embedding", "meta_info"} for one input (a string or one list of ids), a list of
    them for a batch."""
    items = [{"embedding": v, "meta_info": {"prompt_tokens": n, "finish_reason": {"type": "stop"}}}
             for v, n in zip(vectors, tokens)]
    single = isinstance(value, str) or (isinstance(value, list) and bool(value) and _is_id(value[0]))
    return items[0] if single else items
