"""SGLang's program surface: @function, gen, select, roles, fork, run, run_batch, bind.

An SGLang program ports by changing `import sglang as sgl` to `import plait as sgl`.
"""

from __future__ import annotations

import functools
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from plait.lang.backends.base import METHODS, Backend
from plait.lang.interpreter import ProgramState
from plait.lang.ir import Gen, RoleBegin, RoleEnd, Select, Seq, as_expr
from plait.lang.tracer import common_prefix

token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized = METHODS

# gen() keyword -> sampling_params key
_PARAM_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "stop": "stop",
                "stop_token_ids": "stop_token_ids", "temperature": "temperature", "top_p": "top_p",
                "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
                "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
                "ignore_eos": "ignore_eos", "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf",
                "seed": "seed"}


class _Defaults:
    """The default backend of `run` (SGLang's `set_default_backend`); the one process-wide setting
    the API needs."""

    backend: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a plait backend (Runtime, RuntimeEndpoint, OpenAI), got {type(backend).__name__}")
    _Defaults.backend = backend


def get_default_backend() -> Backend | None:
    return _Defaults.backend


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        repetition_penalty: float | None = None, ignore_eos: bool | None = None, seed: int | None = None,
        dtype: type | None = None, choices: list[str] | None = None, choices_method: str | None = None,
        regex: str | None = None, json_schema: str | dict | None = None, ebnf: str | None = None,
        return_logprob: bool | None = None, top_logprobs_num: int | None = None, **unknown) -> Gen | Select:
    if unknown:
        raise TypeError(f"gen() got unknown argument(s) {sorted(unknown)}")
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    given = {k: v for k, v in locals().items() if k in _PARAM_NAMES and v is not None}
    if isinstance(given.get("json_schema"), dict):
        import json

        given["json_schema"] = json.dumps(given["json_schema"])
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    params = {_PARAM_NAMES[k]: v for k, v in given.items()}
    return Gen(name, params, dtype, bool(return_logprob), top_logprobs_num or 0)


def gen_int(name: str | None = None, **kwargs) -> Gen:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs) -> Gen:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: str = token_length_normalized) -> Select:
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select needs a non-empty list of string choices")
    if choices_method not in METHODS:
        raise ValueError(f"choices_method must be one of {list(METHODS)}, got {choices_method!r}")
    return Select(name, list(choices), choices_method, temperature)


def _role(role: str, expr: Any = None) -> Seq:
    return Seq([RoleBegin(role), *([] if expr is None else [as_expr(expr)]), RoleEnd(role)])


def system(expr: Any = None) -> Seq:
    return _role("system", expr)


def user(expr: Any = None) -> Seq:
    return _role("user", expr)


def assistant(expr: Any = None) -> Seq:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


class SglFunction:
    def __init__(self, func: Callable, bound: dict[str, Any] | None = None):
        self.func = func
        self.bound = dict(bound or {})
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError("a @function's first argument is the program state (s)")
        self.arg_names = params[1:]
        functools.update_wrapper(self, func)

    def bind(self, **kwargs) -> "SglFunction":
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no argument(s) {sorted(unknown)}")
        return SglFunction(self.func, {**self.bound, **kwargs})

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)

    def _backend(self, backend: Backend | None) -> Backend:
        backend = backend or _Defaults.backend
        if backend is None:
            raise RuntimeError("no backend: pass backend=... or call plait.set_default_backend(...)")
        return backend

    def run(self, *args, max_new_tokens: int | None = None, temperature: float | None = None,
            top_p: float | None = None, top_k: int | None = None, stop: str | list[str] | None = None,
            stream: bool = False, backend: Backend | None = None, **kwargs) -> ProgramState:
        """Run once. Returns the state at once when stream=True (iterate s.text_iter()), else when done."""
        backend = self._backend(backend)
        defaults = {k: v for k, v in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                                      ("top_p", top_p), ("top_k", top_k), ("stop", stop)) if v is not None}
        if isinstance(defaults.get("stop"), str):
            defaults["stop"] = [defaults["stop"]]
        defaults.setdefault("max_new_tokens", 128)
        s = ProgramState(backend, defaults, stream=stream)
        try:
            self.func(s, *args, **{**self.bound, **kwargs})
        finally:
            s.end()
        if not stream:
            s.sync()
        return s

    def run_batch(self, batch_kwargs: list[dict], *, num_threads: int | str = "auto", progress_bar: bool = False,
                  backend: Backend | None = None, **run_kwargs) -> list[ProgramState]:
        """Run once per argument dict, concurrently. The programs' common constant prefix (traced
        without the model) is computed once first, so every run reads it from the prefix cache."""
        if not isinstance(batch_kwargs, list) or not all(isinstance(b, dict) for b in batch_kwargs):
            raise TypeError("run_batch takes a list of argument dicts")
        if not batch_kwargs:
            return []
        backend = self._backend(backend)
        prefix = self._common_prefix(backend, batch_kwargs)
        if prefix:
            backend.cache_prefix(prefix)
        workers = min(len(batch_kwargs), 64) if num_threads == "auto" else max(int(num_threads), 1)
        results: list[ProgramState | None] = [None] * len(batch_kwargs)

        def one(i: int) -> None:
            results[i] = self.run(backend=backend, **run_kwargs, **batch_kwargs[i])

        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(batch_kwargs))
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(one, range(len(batch_kwargs))):
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]

    def _common_prefix(self, backend: Backend, batch_kwargs: list[dict]) -> str:
        return common_prefix(self.func, backend.roles(), [{**self.bound, **kw} for kw in batch_kwargs])


def function(func: Callable | None = None, **_options):
    """`@function` (or `@function()`): a prompt program whose first argument is the state."""
    if func is None:
        return lambda f: SglFunction(f)
    return SglFunction(func)
