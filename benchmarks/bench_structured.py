"""Structured-output benchmark, side by side in one run:

1. per-token latency of constrained vs unconstrained decoding at batch 1 and batch 32
   (jump-forward off, so both sample every token; the unconstrained run decodes exactly as
   many tokens per request as its constrained twin);
2. JSON-schema requests per second with jump-forward on vs off (same requests, greedy);
3. completion with the model over a sample of the real-world schema corpus: refused, complete and
   valid (at the grammar's end, or closed early as the budget ran low), cut, invalid;
4. over the whole corpus, for every backend and `auto`: coverage (compiled / rejected / over the
   timeout), compile p50/p99, and the mask fill's cost per token; `served` is `auto` as the
   scheduler runs it (compile workers; a backend past half the time left falls through).

    python benchmarks/bench_structured.py                    # all four, table in results/structured.md
    python benchmarks/bench_structured.py --skip-compile     # 1 to 3
    python benchmarks/bench_structured.py --only-completion  # 3
    python benchmarks/bench_structured.py --only-compile     # 4
    python benchmarks/bench_structured.py --corpus benchmarks/data/api_schemas.jsonl.gz --only-compile --backends served
                                          # 4 over the schemas real APIs publish (benchmarks/api_corpus.py)
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
from bench_peers import cpu_name  # noqa: E402
from report import save_results  # noqa: E402
CORPUS = os.path.join(HERE, "..", "tests", "data", "schemas", "corpus.jsonl")

# a long but bounded JSON output: 24 short strings
LIST_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "items": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 24, "maxItems": 24}},
    "required": ["title", "items"]}
# many fixed keys and enums: what jump-forward is for
RECORD_SCHEMA = {"type": "object", "properties": {
    "first_name": {"type": "string", "maxLength": 16}, "last_name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "country": {"enum": ["United States of America", "United Kingdom", "New Zealand", "South Africa"]},
    "employment_status": {"enum": ["full_time_employee", "part_time_employee", "self_employed", "unemployed"]},
    "is_subscribed_to_newsletter": {"type": "boolean"},
    "preferred_contact_method": {"enum": ["electronic_mail", "telephone_call", "postal_mail"]},
    "account_tier": {"enum": ["basic_membership", "premium_membership", "enterprise_membership"]}},
    "required": ["first_name", "last_name", "age", "country", "employment_status", "is_subscribed_to_newsletter",
                 "preferred_contact_method", "account_tier"]}


def chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def run_batch(engine, prompts: list[str], params: list[dict]) -> tuple[float, list[dict]]:
    """All requests in flight at once; wall time and results."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda a: engine.generate(*a), zip(prompts, params)))
    return time.perf_counter() - t0, outs


def per_token_overhead(args) -> list[tuple]:
    from plait import Engine

    eng = Engine(num_threads=args.threads, dtype="float32", log_level="warning", disable_jump_forward=True,
                 max_total_tokens=65536)
    tok = eng.tokenizer
    rows = []
    try:
        eng.generate("warm up", {"max_new_tokens": 4})
        for batch in (1, 32):
            prompts = [chat(tok, f"List 24 words about topic number {i}, as JSON.") for i in range(batch)]
            cons = [{"json_schema": json.dumps(LIST_SCHEMA), "temperature": 0.8, "seed": i, "max_new_tokens": 512}
                    for i in range(batch)]
            t_c, outs = run_batch(eng, prompts, cons)
            lens = [o["meta_info"]["completion_tokens"] for o in outs]
            free = [{"temperature": 0.8, "seed": i, "max_new_tokens": n, "ignore_eos": True} for i, n in enumerate(lens)]
            eng.flush_cache()
            t_u, _ = run_batch(eng, prompts, free)
            eng.flush_cache()
            t_c2, _ = run_batch(eng, prompts, cons)  # twice, interleaved: the machine is noisy
            eng.flush_cache()
            t_u2, _ = run_batch(eng, prompts, free)
            eng.flush_cache()
            toks = sum(lens)
            c, u = min(t_c, t_c2) / toks * batch, min(t_u, t_u2) / toks * batch
            rows.append((batch, toks, u * 1000, c * 1000, (c / u - 1) * 100))
    finally:
        eng.shutdown()
    return rows


def jump_forward_speedup(args) -> list[tuple]:
    """(concurrency, req/s off, req/s on, passes off, passes on, tokens, identical outputs)."""
    from plait import Engine

    runs: dict[tuple[bool, int], tuple] = {}
    for jf in (False, True):
        eng = Engine(num_threads=args.threads, dtype="float32", log_level="warning", disable_jump_forward=not jf,
                     max_total_tokens=65536)
        tok = eng.tokenizer
        try:
            params = {"json_schema": json.dumps(RECORD_SCHEMA), "temperature": 0, "max_new_tokens": 256}
            eng.generate(chat(tok, "warm up"), params)  # compiles the grammar once
            for conc, n in ((1, 6), (args.jf_requests, args.jf_requests)):
                prompts = [chat(tok, f"Make up customer record {i} as JSON.") for i in range(n)]
                eng.flush_cache()
                before = eng.get_server_info()["forward_passes"]
                t0 = time.perf_counter()
                if conc == 1:
                    outs = [eng.generate(p, params) for p in prompts]
                else:
                    outs = run_batch(eng, prompts, [params] * n)[1]
                dt = time.perf_counter() - t0
                passes = eng.get_server_info()["forward_passes"] - before
                runs[(jf, conc)] = (n / dt, passes, sum(o["meta_info"]["completion_tokens"] for o in outs),
                                    [o["text"] for o in outs])
        finally:
            eng.shutdown()
    rows = []
    for conc in (1, args.jf_requests):
        off, on = runs[(False, conc)], runs[(True, conc)]
        same = sum(a == b for a, b in zip(off[3], on[3]))
        rows.append((conc, off[0], on[0], off[1], on[1], on[2], f"{same}/{len(on[3])}"))
    return rows


def _compile_worker(backend_name: str, jobs, results) -> None:
    import logging

    logging.disable(logging.WARNING)
    from plait.runtime.constrained import GrammarError, create_backend
    from plait.runtime.model_loader import load_tokenizer
    from plait.runtime.server_args import default_model_path

    import torch

    from plait.runtime.constrained.bitmask import allocate_bitmask

    tok = load_tokenizer(default_model_path())
    backend = create_backend(backend_name, tok, 49152, [tok.eos_token_id])
    bitmask = allocate_bitmask(1, 49152)
    results.put(("ready", None, 0.0, None, []))
    while True:
        job = jobs.get()
        if job is None:
            return
        i, text, instance = job
        t0 = time.perf_counter()
        fills, chosen = [], None
        try:
            compiled = backend.compile("json_schema", text)
            status, chosen = "ok", compiled.backend
        except GrammarError:
            status = "rejected"
        except Exception:  # noqa: BLE001 - a backend crash counts as a rejection
            status = "rejected"
        dt = time.perf_counter() - t0
        if status == "ok" and instance is not None:
            # the mask at every position of a valid instance (compact layout), as a request would fill them
            m = compiled.matcher()
            with torch.inference_mode():
                for t in tok.encode(instance, add_special_tokens=False):
                    t1 = time.perf_counter()
                    m.fill_bitmask(bitmask, 0)
                    fills.append(time.perf_counter() - t1)
                    if not m.accept_token(t):
                        break
        results.put((status, i, dt, chosen, fills))


def compile_times(backend_name: str, schemas: list[str], instances: list[str | None], timeout: float) -> dict:
    """Compile every schema in a worker process (a runaway compile is killed at `timeout`), and time
    the mask fills along one valid instance of each compiled schema."""
    ctx = mp.get_context("spawn")
    stats = {"ok": [], "rejected": [], "timeout": [], "fills": [], "chosen": {}, "by_index": {}}
    i = 0
    while i < len(schemas):
        jobs, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_compile_worker, args=(backend_name, jobs, results), daemon=True)
        proc.start()
        results.get(timeout=120)
        while i < len(schemas):
            jobs.put((i, schemas[i], instances[i]))
            try:
                # the mask walk after the compile gets its own margin; a compile over the timeout counts as one
                status, _, dt, chosen, fills = results.get(timeout=timeout + 30)
                if status == "ok" and dt > timeout:
                    status, chosen, fills = "timeout", None, []
                stats[status].append(dt)
                if status == "ok":
                    stats["by_index"][i] = dt
                stats["fills"] += fills
                if chosen:
                    stats["chosen"][chosen] = stats["chosen"].get(chosen, 0) + 1
            except Exception:  # noqa: BLE001 - queue.Empty: over the timeout
                stats["timeout"].append(timeout)
                proc.kill()
                i += 1
                break
            i += 1
        else:
            jobs.put(None)
        proc.join(timeout=5)
    return stats


def served_compile_times(schemas: list[str], instances: list[str | None], timeout: float) -> dict:
    """`auto` as the scheduler compiles: in compile worker processes, each backend but the last given at
    most half of the time left (a runaway xgrammar compile falls through to llguidance); the mask
    fills timed along one valid instance, as in compile_times."""
    import torch

    from plait.runtime.constrained import GrammarError, JsonStyle, create_backend
    from plait.runtime.constrained.bitmask import allocate_bitmask
    from plait.runtime.constrained.compile_worker import IsolatedCompiler, WorkerConfig
    from plait.runtime.model_loader.tokenizer import grammar_vocab
    from plait.runtime.server_args import default_model_path

    tok, vocab_size, eos_ids = grammar_vocab(default_model_path())
    backend = create_backend("auto", tok, vocab_size, eos_ids)
    compiler = IsolatedCompiler(backend, WorkerConfig("auto", default_model_path()), timeout)
    compiler.start()
    compiler.worker.wait_ready()
    stats = {"ok": [], "rejected": [], "timeout": [], "fills": [], "chosen": {}, "by_index": {}}
    bitmask = allocate_bitmask(1, vocab_size)
    try:
        for i, (text, instance) in enumerate(zip(schemas, instances)):
            t0 = time.perf_counter()
            try:
                compiled = compiler.compile("json_schema", text, JsonStyle(), lambda: None)
            except GrammarError as e:
                stats["timeout" if "did not compile within" in str(e) or "no time was left" in str(e)
                      else "rejected"].append(time.perf_counter() - t0)
                compiler.worker.wait_ready()  # a killed worker's replacement starts outside the clock
                continue
            stats["ok"].append(time.perf_counter() - t0)
            stats["by_index"][i] = stats["ok"][-1]
            stats["chosen"][compiled.backend] = stats["chosen"].get(compiled.backend, 0) + 1
            if instance is not None:
                m = compiled.matcher()
                with torch.inference_mode():
                    for t in tok.encode(instance, add_special_tokens=False):
                        t1 = time.perf_counter()
                        m.fill_bitmask(bitmask, 0)
                        stats["fills"].append(time.perf_counter() - t1)
                        if not m.accept_token(t):
                            break
    finally:
        compiler.close()
    return stats


def _validator(row: dict):
    """The row's validator, with multipleOf decided exactly as JSON Schema defines it (in fractions of the decimal
    texts): jsonschema divides in floats, so it refuses -10.1223 as a multiple of 0.0001."""
    from fractions import Fraction

    import jsonschema

    def multiple_of(validator, divisor, instance, schema):
        if validator.is_type(instance, "number") and (Fraction(str(instance)) / Fraction(str(divisor))).denominator != 1:
            yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor}")

    # anyOf/oneOf judge each branch once per value (stopping at its first error): jsonschema lists every error
    # of every branch, again at each level, which takes exponential time in a document nested through them (a
    # recursive schema the model kept nesting). The document and schema outlive the memo, so ids stay unique.
    memo: dict[tuple[int, int], bool] = {}

    def valid(validator, instance, i: int, branch) -> bool:
        key = (id(branch), id(instance))
        if key not in memo:
            memo[key] = next(validator.descend(instance, branch, schema_path=i), None) is None
        return memo[key]

    def any_of(validator, branches, instance, schema):
        if not any(valid(validator, instance, i, b) for i, b in enumerate(branches)):
            yield jsonschema.ValidationError(f"{instance!r} is not valid under any of the given schemas")

    def one_of(validator, branches, instance, schema):
        matched = [i for i, b in enumerate(branches) if valid(validator, instance, i, b)]
        if len(matched) != 1:
            yield jsonschema.ValidationError(f"{instance!r} is valid under {len(matched)} of the oneOf's branches")

    cls = getattr(jsonschema, row["draft"] + "Validator")
    cls = jsonschema.validators.extend(cls, {"multipleOf": multiple_of, "anyOf": any_of, "oneOf": one_of})
    return cls(row["schema"], format_checker=cls.FORMAT_CHECKER)


class RepeatedKey(ValueError):
    """An object holds a key twice: a parser keeps the last, so the schema judged other values than were written."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise RepeatedKey(f"a key is repeated in {[k for k, _ in pairs]}")
    return out


def completion_table(args) -> list[str]:
    """Every `--completion-every`th corpus schema generated with the model (sampled, `--completion-tokens` at
    most, 8 in flight): how many are refused, end complete and valid (the grammar's end, or closed early as the
    budget ran low), come back cut, or come back invalid."""

    from plait import Engine

    rows = read_corpus(args.corpus)[::args.completion_every]
    eng = Engine(num_threads=args.threads, log_level="warning", max_total_tokens=65536)
    tok = eng.tokenizer
    counts = {"refused": 0, "complete": 0, "closed": 0, "cut": 0, "invalid": 0, "error": 0}

    def one(row: dict) -> str:
        text = json.dumps(row["schema"])
        prompt = chat(tok, "Write a JSON document that follows this JSON schema:\n" + text[:1500])
        try:
            out = eng.generate(prompt, {"json_schema": text, "temperature": 0.7, "seed": 1,
                                        "max_new_tokens": args.completion_tokens})
        except ValueError:
            return "refused"
        except Exception as e:  # noqa: BLE001 - the server failed the request: counted, and the run goes on
            print(f"error: {row['id']}: {e}", file=sys.stderr, flush=True)
            return "error"
        finish = out["meta_info"]["finish_reason"]
        try:
            doc = json.loads(out["text"], object_pairs_hook=_unique_keys)
        except RepeatedKey as e:
            print(f"invalid: {row['id']}: {e}", file=sys.stderr, flush=True)
            return "invalid"
        except json.JSONDecodeError as e:
            if finish["type"] == "length":
                return "cut"
            print(f"invalid: {row['id']}: does not parse ({e}; finish {finish}): {out['text'][-300:]!r}",
                  file=sys.stderr, flush=True)
            return "invalid"
        error = next(_validator(row).iter_errors(doc), None)
        if error is not None:
            print(f"invalid: {row['id']}: {error.json_path}: {error.message[:200]}", file=sys.stderr, flush=True)
            return "invalid"
        return "complete" if finish["type"] == "stop" else "closed"

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(8) as pool:
            for row, outcome in zip(rows, pool.map(one, rows)):
                counts[outcome] += 1
                if outcome in ("cut", "error"):
                    print(f"{outcome}: {row['id']}", file=sys.stderr, flush=True)
    finally:
        eng.shutdown()
    accepted = len(rows) - counts["refused"]
    done = counts["complete"] + counts["closed"]
    which = f"every {args.completion_every}th corpus schema" if args.completion_every > 1 else "every schema"
    return [f"**Completion with the model** ({which}: {len(rows)}; temperature "
            f"0.7, max_new_tokens {args.completion_tokens}, 8 in flight; {time.perf_counter() - t0:.0f} s)", "",
            "| schemas | refused | accepted | complete | closed early (complete) | cut | invalid | server errors | "
            "complete and valid |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {len(rows)} | {counts['refused']} | {accepted} | {counts['complete']} | {counts['closed']} | "
            f"{counts['cut']} | {counts['invalid']} | {counts['error']} | "
            f"**{done}/{accepted} ({100 * done / max(accepted, 1):.0f}%)** |"]


def read_corpus(path: str) -> list[dict]:
    """The rows of a corpus in the row format of tests/data/schemas (JSON lines, gzipped where the name says)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def timing_tables(args) -> list[str]:
    lines = ["**Per-token latency, constrained (JSON schema) vs unconstrained** (jump-forward off; same token "
             "counts; best of two interleaved runs)", "",
             "| batch | tokens | unconstrained ms/token | constrained ms/token | overhead |", "|---|---|---|---|---|"]
    for b, toks, u, c, over in per_token_overhead(args):
        lines.append(f"| {b} | {toks} | {u:.1f} | {c:.1f} | {over:+.1f}% |")
    print("\n".join(lines), flush=True)
    lines += ["", "**JSON-schema requests/s, jump-forward on vs off** (greedy; a schema with fixed keys and long enum "
                  "values)", "",
              "| concurrent requests | req/s off | req/s on | speed-up | forward passes off / on | output tokens | "
              "identical outputs |", "|---|---|---|---|---|---|---|"]
    for conc, off, on, p_off, p_on, toks, same in jump_forward_speedup(args):
        lines.append(f"| {conc} | {off:.2f} | {on:.2f} | **{on / off:.2f}x** | {p_off} / {p_on} | {toks} | {same} |")
    print("\n".join(lines[-4:]), flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--corpus", default=CORPUS, help="JSON lines of schemas in the corpus's row format (another set "
                    "is measured, not saved)")
    ap.add_argument("--jf-requests", type=int, default=16)
    ap.add_argument("--compile-timeout", type=float, default=10.0)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--only-compile", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--completion-every", type=int, default=5, help="every Nth corpus schema in the completion table")
    ap.add_argument("--completion-tokens", type=int, default=512)
    ap.add_argument("--skip-completion", action="store_true")
    ap.add_argument("--only-completion", action="store_true")
    ap.add_argument("--backends", default="xgrammar,llguidance,outlines,auto,served",
                    help="for the corpus table (served: auto as the scheduler compiles, in worker processes)")
    args = ap.parse_args()
    cmd = "python benchmarks/bench_structured.py " + " ".join(sys.argv[1:])
    lines = [f"`{cmd}` (fp32, {args.threads} threads, default model; CPU: {cpu_name()}; load average "
             f"{os.getloadavg()[0]:.2f} at the start)", ""]

    if not args.only_compile and not args.only_completion:
        lines += timing_tables(args)

    if not args.skip_completion and not args.only_compile:
        lines += [""] + completion_table(args)
        print("\n".join(lines[-5:]), flush=True)

    if not args.skip_compile and not args.only_completion:
        rows = read_corpus(args.corpus)
        schemas = [json.dumps(r["schema"]) for r in rows]
        # the largest tenth by size: what a compile budget must hold (OpenAPI bodies, Vega-Lite, settings schemas)
        largest = sorted(range(len(schemas)), key=lambda k: -len(schemas[k]))[:max(1, len(schemas) // 10)]
        instances = [next((json.dumps(t["data"], ensure_ascii=False) for t in r["tests"] if t["valid"]), None)
                     for r in rows]
        lines += ["", f"**Grammar backends over the {len(schemas)}-schema corpus** (compile timeout "
                      f"{args.compile_timeout:g} s per schema; mask fill per token along one valid instance of each "
                      "compiled schema, compact layout, one thread)", "",
                  "| backend | compiled | rejected (400) | over timeout | compile p50 ms | compile p99 ms | "
                  f"largest tenth ({len(largest)}, from {len(schemas[largest[-1]]) // 1000} kB): compiled, p99 ms | "
                  "mask mean µs/token | mask p99 µs | compiled by |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name in args.backends.split(","):
            if name == "served":
                st = served_compile_times(schemas, instances, args.compile_timeout)
            else:
                st = compile_times(name, schemas, instances, args.compile_timeout)
            ok, fills = st["ok"], st["fills"]
            by = ", ".join(f"{k} {v}" for k, v in sorted(st["chosen"].items(), key=lambda kv: -kv[1]))
            mean = sum(fills) / len(fills) * 1e6 if fills else float("nan")
            big = [st["by_index"][k] for k in largest if k in st["by_index"]]
            lines.append(f"| {name} | {len(ok)} | {len(st['rejected'])} | {len(st['timeout'])} | "
                         f"{pct(ok, 0.5) * 1000:.1f} | {pct(ok, 0.99) * 1000:.0f} | "
                         f"{len(big)}, {pct(big, 0.99) * 1000:.0f} | {mean:.0f} | "
                         f"{pct(fills, 0.99) * 1e6:.0f} | {by} |")
            print(lines[-1], flush=True)

    table = "\n".join(lines)
    print("\n" + table)
    partial = args.skip_compile or args.only_compile or args.only_completion
    if not args.no_save and args.corpus == CORPUS and not partial:
        save_results("structured.md", table)


if __name__ == "__main__":
    main()
