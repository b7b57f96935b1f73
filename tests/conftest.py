"""Shared fixtures: one real engine (its runtime processes) on the default model, an in-process
model runner for logits tests, transformers references, and the API tests' server with its clients."""

from __future__ import annotations

import os
import signal

import pytest
import torch

THREADS = int(os.environ.get("PLAIT_TEST_THREADS", "1"))
torch.set_num_threads(THREADS)
# the agent frameworks' tests run in a venv of their own (`make test-frameworks`, part of `make test-slow`)
collect_ignore = ["frameworks"]
# `make test` runs the files on two workers, a file to a worker, in collection order: the longest start first, so
# that none is left running alone at the end
LONGEST_FIRST = ("test_speculative.py", "test_structured.py", "test_tools.py", "test_grammar_backends.py",
                 "test_engine.py", "test_lang.py", "test_determinism.py", "test_fuzz.py", "test_moe.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def engine():
    from plait import Engine

    eng = Engine(num_threads=THREADS, max_total_tokens=16384, dtype="float32", log_level="warning")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, as the engine's client loads it (no engine started for it)."""
    from plait.runtime.model_loader.tokenizer import load_tokenizer
    from plait.runtime.server_args import default_model_path

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def runner_args():
    """The configuration `runner` was built with (a scheduler over it starts from these)."""
    from plait.runtime.server_args import ServerArgs

    return ServerArgs(num_threads=THREADS, max_total_tokens=4096, dtype="float32", log_level="warning").resolved()


@pytest.fixture(scope="session")
def runner(runner_args):
    """The default model in this process (no scheduler), for logits-level checks."""
    from plait.runtime.model_executor.model_runner import ModelRunner

    return ModelRunner(runner_args, progress=False)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' LlamaForCausalLM with the default model's weights, loaded by transformers itself
    from the GGUF (its own dequantization and Q/K un-permutation: an independent reference)."""
    from plait.runtime.server_args import default_model_path
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def chat_prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.fixture(scope="session")
def backends(tokenizer):
    """The three grammar backends over the default model's tokenizer (no model)."""
    from plait.runtime.constrained import create_backend

    eos = [tokenizer.eos_token_id]
    return {name: create_backend(name, tokenizer, 49152, eos) for name in ("xgrammar", "llguidance", "outlines")}


# the API tests' server (test_server*.py): one per module that asks for it; modules with a server of their own
# define their own `server`
@pytest.fixture(scope="module")
def server():
    from server_util import api_server

    srv = api_server()
    yield srv
    # graceful shutdown on SIGTERM: exit code 0
    assert srv.stop(signal.SIGTERM) == 0


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI
    from server_util import KEY

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
