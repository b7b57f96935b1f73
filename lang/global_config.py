"""`global_config`: the frontend's process-wide settings, with SGLang's names and defaults.

It is the one mutable setting SGLang's API defines (`set_default_backend` writes
`default_backend`), so it is kept as the API has it rather than hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    verbosity: int = 0  # 2: print each program's final text when it ends
    default_backend: Any = None  # the Backend `run` uses when none is passed
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    enable_precache_with_tracing: bool = True  # run_batch computes the traced common prefix first
    enable_parallel_encoding: bool = True  # join(mode="concate_and_append") reuses the branches' KV


global_config = GlobalConfig()
