"""SGLang's own test programs (`sglang/test/test_programs.py` of the installed sglang), loaded with
only the import changed, and run one by one with each outcome classified.

    python tests/sglang_programs.py --url URL      # the plait frontend on RuntimeEndpoint(URL); JSON out

The file is read from the installed package, so the check follows SGLang's programs, not a copy.
The import change is `import sglang as sgl` -> `import plait as sgl` and `sglang.lang.` ->
`plait.lang.`. One server-side utility the file imports is mapped for both frontends:
`sglang.srt.utils.hf_transformers_utils.get_tokenizer` needs SGLang's server dependencies
(torchvision), so it becomes plait's tokenizer loader; `sglang.srt.utils.is_hip` stays SGLang's.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import re
import sys
import time
import types
import warnings
from pathlib import Path

# programs whose assertions are about what the model answers (facts, arithmetic, a well-formed
# JSON before max_tokens): a failure there is reported as the model's answer, not a failure of the
# DSL. The rest assert what the DSL and the server do and must pass.
ANSWER_CHECKS = {
    "test_few_shot_qa": "capitals", "test_select": "true/false/unknown judgements",
    "test_decode_int": "24 hours, 365 days", "test_expert_answer": "'paris' in the text",
    "test_react": "Finland or the States", "test_parallel_encoding": "'Noah' in the answer",
    "test_tool_use": "the product 257 x 983", "test_decode_json": "JSON closed within max_tokens",
    "test_decode_json_regex": "JSON closed within max_tokens",
    # speculation saves prompt tokens only when the sampled text (default temperature, server-assigned
    # seeds that follow the arrival order of the concurrent runs) keeps the Name/Birthday/Job format
    "test_completion_speculative": "the sampled character keeps the format",
}
# answer checks SmolLM2-135M passes (at temperature 0): enforced
RELIABLE_ANSWERS = {"test_tool_use", "test_decode_json_regex"}
NEEDS_IMAGE = {"test_image_qa"}
# SGLang 0.5.23's interpreter reads backend.is_chat_model, which its own RuntimeEndpoint lacks
# (num_api_spec_tokens inside a role): the program fails in SGLang's frontend whatever the server
SGLANG_OWN_BUG = "'RuntimeEndpoint' object has no attribute 'is_chat_model'"
# what SGLang's own frontend cannot run on a native backend, whatever the server
SGLANG_FRONTEND_NA = {"test_completion_speculative": "reads backend.token_usage, which SGLang's frontend keeps on "
                                                     "its OpenAI backend only"}


def programs_file() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("sglang is not installed (make test installs it with --no-deps)")
    return Path(spec.submodule_search_locations[0]) / "test" / "test_programs.py"


def load(frontend: str) -> types.ModuleType:
    """The programs module with its imports pointed at `frontend` ("plait" or "sglang")."""
    path = programs_file()
    code = path.read_text()
    if frontend == "plait":
        code = re.sub(r"\bimport sglang as sgl\b", "import plait as sgl", code)
        code = code.replace("from sglang.lang.", "from plait.lang.")
    code = code.replace("from sglang.srt.utils.hf_transformers_utils import get_tokenizer",
                        "from plait.runtime.model_loader import load_tokenizer as get_tokenizer")
    mod = types.ModuleType(f"sglang_test_programs_{frontend}")
    mod.__file__ = str(path)
    exec(compile(code, str(path), "exec"), mod.__dict__)
    return mod


def names(mod: types.ModuleType) -> list[str]:
    return sorted(n for n in vars(mod) if n.startswith("test_") and callable(getattr(mod, n)) and n not in NEEDS_IMAGE)


def run_one(mod: types.ModuleType, name: str, frontend: str) -> dict:
    """{"outcome": ok | answer | n/a | fail, "detail", "seconds"}."""
    if frontend == "sglang" and name in SGLANG_FRONTEND_NA:
        return {"outcome": "n/a", "detail": SGLANG_FRONTEND_NA[name], "seconds": 0.0}
    fn = getattr(mod, name)
    kwargs = {"check_answer": True} if "check_answer" in inspect.signature(fn).parameters else {}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn(**kwargs)
        # SGLang's frontend reports an error of its worker thread as a warning and goes on
        swallowed = [str(w.message) for w in caught if "Error in stream_executor" in str(w.message)]
        if swallowed and all(SGLANG_OWN_BUG in m for m in swallowed):
            outcome, detail = "n/a", "SGLang's frontend fails before any request: its RuntimeEndpoint has no is_chat_model"
        elif swallowed:
            outcome, detail = "fail", swallowed[0][-300:]
        else:
            outcome, detail = "ok", ""
    except (AssertionError, json.JSONDecodeError) as e:
        answer = name in ANSWER_CHECKS and name not in RELIABLE_ANSWERS
        outcome, detail = ("answer" if answer else "fail"), f"{type(e).__name__}: {str(e)[:200]}"
    except Exception as e:  # noqa: BLE001 - any other error is a failure of the DSL or the server
        outcome, detail = "fail", f"{type(e).__name__}: {str(e)[:300]}"
    return {"outcome": outcome, "detail": detail, "seconds": round(time.perf_counter() - start, 1)}


def run_all(mod: types.ModuleType, frontend: str) -> dict[str, dict]:
    return {name: run_one(mod, name, frontend) for name in names(mod)}


def table(results: dict[str, dict[str, dict]]) -> str:
    """One row per program, one column per run."""
    runs = list(results)
    rows = [f"| program | {' | '.join(runs)} |", "|---" * (len(runs) + 1) + "|"]
    for name in sorted({n for r in results.values() for n in r}):
        cells = []
        for run in runs:
            r = results[run].get(name, {"outcome": "-", "detail": ""})
            cells.append(r["outcome"] + (f" ({r['detail'][:60]})" if r["outcome"] != "ok" and r["detail"] else ""))
        rows.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="a plait server's base URL")
    args = ap.parse_args()
    import plait

    mod = load("plait")
    backend = plait.RuntimeEndpoint(args.url)
    plait.set_default_backend(backend)
    results = run_all(mod, "plait")
    backend.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
