"""Realistic workloads for the benchmarks, from the registry data of the `evals` package (chat-form
prompts, MIT): install it with `pip install --no-deps evals==3.0.1.post1` (`make bench` does)."""

from __future__ import annotations

import json
import os
import sys
from importlib.util import find_spec


def data_dir() -> str:
    spec = find_spec("evals")
    if spec is None:
        sys.exit("the `evals` package is missing: pip install --no-deps evals==3.0.1.post1")
    return os.path.join(list(spec.submodule_search_locations)[0], "registry", "data")


def samples(name: str) -> list[dict]:
    path = os.path.join(data_dir(), name, "samples.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_prompts(tokenizer, n: int, max_tokens: int = 320) -> list[str]:
    """n chat prompts, a few from each of the registry's datasets in name order."""
    out: list[str] = []
    for name in sorted(os.listdir(data_dir())):
        try:
            rows = samples(name)
        except (OSError, json.JSONDecodeError):
            continue
        taken = 0
        for row in rows:
            msgs = row.get("input")
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                     for m in msgs):
                continue
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            if 16 <= len(tokenizer.encode(text)) <= max_tokens:
                out.append(text)
                taken += 1
            if taken == 2 or len(out) == n:
                break
        if len(out) == n:
            return out
    return out


def few_shot_workload(tokenizer, n: int, prefix_tokens: int = 1500) -> tuple[str, list[str]]:
    """A few-shot multiple-choice prefix of about prefix_tokens tokens, and n questions after it."""
    rows = samples("medmcqa")
    system = rows[0]["input"][0]["content"]
    prefix = system + "\n\n"
    i = 0
    while len(tokenizer.encode(prefix)) < prefix_tokens:
        prefix += f"Question: {rows[i]['input'][-1]['content']}\nAnswer: {rows[i]['ideal']}\n\n"
        i += 1
    questions = [f"Question: {r['input'][-1]['content']}\nAnswer:" for r in rows[i : i + n]]
    return prefix, questions
