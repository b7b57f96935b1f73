"""The prompt-program DSL: `import plait as pl` re-exports it."""

from plait.lang.api import (SglFunction, assistant, assistant_begin, assistant_end, function, gen, gen_int,
                            gen_string, get_default_backend, greedy_token_selection, select, set_default_backend,
                            system, system_begin, system_end, token_length_normalized,
                            unconditional_likelihood_normalized, user, user_begin, user_end)
from plait.lang.backends.base import Backend
from plait.lang.backends.endpoint import RuntimeEndpoint
from plait.lang.backends.openai import OpenAI
from plait.lang.backends.runtime import Runtime
from plait.lang.interpreter import ForkGroup, ProgramState

__all__ = ["Backend", "ForkGroup", "OpenAI", "ProgramState", "Runtime", "RuntimeEndpoint", "SglFunction", "assistant",
           "assistant_begin", "assistant_end", "function", "gen", "gen_int", "gen_string", "get_default_backend",
           "greedy_token_selection", "select", "set_default_backend", "system", "system_begin", "system_end",
           "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin", "user_end"]
