"""The prompt-program DSL: `import plait as pl` re-exports it (SGLang's `sglang.lang` surface)."""

from plait.lang.api import (SglFunction, assistant, assistant_begin, assistant_end, embed, flush_cache, function, gen,
                            gen_int, gen_string, get_default_backend, get_server_info, greedy_token_selection, image,
                            select, separate_reasoning, set_default_backend, system, system_begin, system_end,
                            token_length_normalized, unconditional_likelihood_normalized, user, user_begin, user_end,
                            video)
from plait.lang.backends.base import Backend
from plait.lang.backends.endpoint import RuntimeEndpoint
from plait.lang.backends.openai import OpenAI
from plait.lang.backends.runtime import Runtime
from plait.lang.global_config import global_config
from plait.lang.fork import ForkGroup, ProgramStateGroup
from plait.lang.interpreter import ProgramState

__all__ = ["Backend", "ForkGroup", "OpenAI", "ProgramState", "ProgramStateGroup", "Runtime", "RuntimeEndpoint",
           "SglFunction", "assistant", "assistant_begin", "assistant_end", "embed", "flush_cache", "function", "gen", "gen_int",
           "gen_string", "get_default_backend", "get_server_info", "global_config", "greedy_token_selection", "image",
           "select", "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
           "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video"]
