"""SGLang's program surface: @function, gen, select, roles, fork, run, run_batch, bind.

An SGLang program ports by changing `import sglang as sgl` to `import plait as sgl`.
"""

from __future__ import annotations

import functools
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from plait.lang.backends.base import METHODS, Backend, Call
from plait.lang.global_config import global_config
from plait.lang.interpreter import ProgramState
from plait.lang.ir import Embed, Gen, Media, RoleBegin, RoleEnd, Select, SeparateReasoning, Seq, as_expr, gen_names
from plait.lang.tracer import TracedProgram, common_prefix, trace_program

token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized = METHODS

# gen() / run() keyword -> sampling_params key
_PARAM_NAMES = {"max_tokens": "max_new_tokens", "max_new_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
                "n": "n", "stop": "stop", "stop_token_ids": "stop_token_ids", "stop_regex": "stop_regex",
                "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos", "regex": "regex",
                "json_schema": "json_schema", "ebnf": "ebnf", "seed": "seed"}


def _sampling_params(given: dict[str, Any]) -> dict[str, Any]:
    params = {_PARAM_NAMES[k]: v for k, v in given.items() if k in _PARAM_NAMES and v is not None}
    if isinstance(params.get("json_schema"), dict):
        import json

        params["json_schema"] = json.dumps(params["json_schema"])
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    return params


def set_default_backend(backend: Backend) -> None:
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a plait backend (Runtime, RuntimeEndpoint, OpenAI), got {type(backend).__name__}")
    global_config.default_backend = backend


def get_default_backend() -> Backend | None:
    return global_config.default_backend


def flush_cache(backend: Backend | None = None) -> bool:
    """Drop the backend's prefix cache (False when requests are running or there is no backend)."""
    backend = backend or global_config.default_backend
    return False if backend is None else backend.flush_cache()


def get_server_info(backend: Backend | None = None) -> dict | None:
    backend = backend or global_config.default_backend
    return None if backend is None else backend.get_server_info()


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, n: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: type | str | None = None,
        choices: list[str] | None = None, choices_method: str | None = None, regex: str | None = None,
        json_schema: str | dict | None = None, ebnf: str | None = None, repetition_penalty: float | None = None,
        seed: int | None = None, lora: str | None = None, **unknown) -> Gen | Select:
    """Call the model (SGLang's gen; `ebnf`, `repetition_penalty`, `seed` and `lora` (a LoRA adapter the server
    serves; default the program's, `run(lora=...)`) are plait's additions)."""
    if unknown:
        raise TypeError(f"gen() got unknown argument(s) {sorted(unknown)}")
    if choices:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    # a regex is checked by the server's grammar backend (its dialect, not Python's re)
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise ValueError("lora must name a LoRA adapter the server serves")
    return Gen(name, _sampling_params(locals()), dtype, bool(return_logprob), top_logprobs_num or 0,
               logprob_start_len, bool(return_text_in_logprobs), lora)


def embed(name: str, text: str | list[str] | None = None, model: str | None = None) -> Embed:
    """The embedding of `text` (a list of floats, L2-normalized; a list of them for a list of texts; None: the
    program's text so far) in variable `name`, beside the text the program generates. `model`: the server's
    model that embeds (default: its --embedding-model where it has one, else the main model)."""
    if not isinstance(name, str) or not name:
        raise ValueError("embed needs a variable name")
    if text is not None and not (isinstance(text, str) or (isinstance(text, list) and text
                                                           and all(isinstance(t, str) for t in text))):
        raise ValueError("embed's text must be a string, a non-empty list of strings, or None (the program's text)")
    return Embed(name, text, model)


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


def image(path: Any) -> Media:
    """Kept so SGLang programs build; running it raises: plait has no vision model yet."""
    return Media("image", path)


def video(path: str, num_frames: int) -> Media:
    return Media("video", path, num_frames)


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Seq:
    """`s += separate_reasoning(gen("a"), model_type="deepseek-r1")`: after the gen, `a` holds the
    answer and `a_reasoning_content` the reasoning (the `<think>` part)."""
    from plait.lang.reasoning import TAGS

    if model_type is not None and model_type not in TAGS:
        raise ValueError(f"separate_reasoning: unknown model_type {model_type!r}; known: {sorted(TAGS)}")
    e = as_expr(expr) if expr is not None else Seq([])
    names = gen_names(e)
    if expr is not None and not names:
        raise ValueError("separate_reasoning needs a named gen or select")
    return Seq([e, SeparateReasoning(model_type, names)])


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


_RUN_PARAMS = ("max_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
               "min_p", "frequency_penalty", "presence_penalty", "ignore_eos")
_RUN_CALL = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "lora")


def _run_options(kwargs: dict[str, Any]) -> tuple[dict, Call, dict]:
    """Split run()'s keywords into default sampling params, default call fields and the program's arguments."""
    params = _sampling_params({k: kwargs.pop(k) for k in _RUN_PARAMS if k in kwargs})
    params.setdefault("max_new_tokens", 128)
    call = {k: kwargs.pop(k) for k in _RUN_CALL if k in kwargs}
    call = Call(return_logprob=bool(call.get("return_logprob")), top_logprobs_num=call.get("top_logprobs_num") or 0,
                logprob_start_len=call.get("logprob_start_len"),
                return_text_in_logprobs=bool(call.get("return_text_in_logprobs")), lora=call.get("lora"))
    return params, call, kwargs


class SglFunction:
    def __init__(self, func: Callable, bound: dict[str, Any] | None = None, num_api_spec_tokens: int | None = None):
        self.func = func
        self.bound = dict(bound or {})
        self.num_api_spec_tokens = num_api_spec_tokens
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError("a @function's first argument is the program state (s)")
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:] if p.default is not inspect.Parameter.empty]
        functools.update_wrapper(self, func)

    @property
    def bind_arguments(self) -> dict[str, Any]:  # SGLang's name
        return self.bound

    def bind(self, **kwargs) -> "SglFunction":
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no argument(s) {sorted(unknown)}")
        return SglFunction(self.func, {**self.bound, **kwargs}, self.num_api_spec_tokens)

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)

    def _backend(self, backend: Backend | None) -> Backend:
        backend = backend or global_config.default_backend
        if backend is None:
            raise RuntimeError("no backend: pass backend=... or call plait.set_default_backend(...)")
        return backend

    def run(self, *args, stream: bool = False, backend: Backend | None = None, use_thread: bool = True,
            **kwargs) -> ProgramState:
        """Run once. Takes SGLang's run() options (max_new_tokens, temperature, stop, return_logprob, ...)
        as defaults for every gen, the rest as the program's arguments. Returns the state at once when
        stream=True (iterate s.text_iter()), else when done. (Expressions always run on the state's
        thread; use_thread is accepted for SGLang's signature.)"""
        backend = self._backend(backend)
        params, call, kwargs = _run_options(dict(kwargs))
        s = ProgramState(backend, params, stream=stream, call=call, spec_tokens=self.num_api_spec_tokens)
        try:
            s.ret_value = self.func(s, *args, **{**self.bound, **kwargs})
        finally:
            s.end()
        if not stream:
            s.sync()
        return s

    def run_batch(self, batch_kwargs: list[dict] | list[tuple], *, num_threads: int | str = "auto",
                  progress_bar: bool = False, backend: Backend | None = None, generator_style: bool = False,
                  **run_kwargs):
        """Run once per argument dict (or tuple of positional arguments), concurrently. The programs'
        common constant prefix (traced without the model) is computed once first, so every run reads
        it from the prefix cache. generator_style=True yields the states in order as they finish."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts (or of argument tuples)")
        batch = [self._as_kwargs(b) for b in batch_kwargs]
        if not batch:
            return iter(()) if generator_style else []
        backend = self._backend(backend)
        if global_config.enable_precache_with_tracing and len(batch) > 1:
            prefix = common_prefix(self.func, backend.roles(), [{**self.bound, **kw} for kw in batch])
            if prefix:
                backend.cache_prefix(prefix, Call(lora=run_kwargs.get("lora")))  # in the adapter's cache
        workers = min(len(batch), 64) if num_threads == "auto" else max(int(num_threads), 1)
        if generator_style:
            return self._run_stream(batch, workers, progress_bar, backend, run_kwargs)
        return list(self._run_stream(batch, workers, progress_bar, backend, run_kwargs))

    def _run_stream(self, batch: list[dict], workers: int, progress_bar: bool, backend: Backend,
                    run_kwargs: dict) -> Iterator[ProgramState]:
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(batch))
        with ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(self.run, backend=backend, **run_kwargs, **kw) for kw in batch]
            for f in futures:
                yield f.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()

    def _as_kwargs(self, item: Any) -> dict:
        if isinstance(item, dict):
            return item
        if isinstance(item, (list, tuple)):
            required = len(self.arg_names) - len(self.arg_defaults)
            if not required <= len(item) <= len(self.arg_names):
                raise TypeError(f"{self.func.__name__}() takes {required} to {len(self.arg_names)} arguments, "
                                f"got {len(item)}")
            return dict(zip(self.arg_names, item))
        raise TypeError(f"run_batch items must be dicts or tuples, got {type(item).__name__}")

    def trace(self, *, backend: Backend | None = None, **kwargs) -> TracedProgram:
        """Run the body without the model: the expressions it appends, in order, and its constant
        prefix. Arguments not given are placeholders, and so are generated values."""
        backend = backend or global_config.default_backend
        return trace_program(self.func, backend.roles() if backend else None, {**self.bound, **kwargs},
                             self.arg_names)

    def cache(self, backend: Backend | None = None) -> str:
        """Compute the program's constant prefix (the text before its first argument or model call)
        once, so later runs read it from the prefix cache. Returns that prefix ("" if too short)."""
        backend = self._backend(backend)
        traced = trace_program(self.func, backend.roles(), dict(self.bound), self.arg_names, prefix_only=True)
        if len(traced.prefix) > 64:
            backend.cache_prefix(traced.prefix)
            return traced.prefix
        return ""


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None):
    """`@function` (or `@function(num_api_spec_tokens=N)`): a prompt program whose first argument is
    the state. With num_api_spec_tokens, a gen with stop strings asks for N tokens in one call and
    the following gens and constant text consume them while they match (fewer calls)."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
