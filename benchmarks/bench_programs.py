"""Prompt programs (the SGLang paper's workload kinds) on plait's Runtime vs the same programs on
a naive backend (plain transformers: one call at a time, no prefix cache), side by side.

    python benchmarks/bench_programs.py            # table in results/programs.md

Both sides run the identical @function programs through run_batch; plait batches and caches,
the naive backend serializes every call and recomputes every prompt.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plait as pl  # noqa: E402
from workloads import samples  # noqa: E402

from report import save_results  # noqa: E402


def mcq_rows(n: int, skip: int = 0) -> list[dict]:
    out = []
    for r in samples("medmcqa")[skip:]:
        text = r["input"][-1]["content"]
        options = re.findall(r"^([a-d])\) (.+)$", text, flags=re.M)
        if len(options) == 4:
            out.append({"question": text, "options": [o[1] for o in options], "answer": r["ideal"][0]})
        if len(out) == n:
            break
    return out


FEW_SHOT = "".join(f"{r['question']}\nAnswer: {r['answer']}\n\n" for r in mcq_rows(6, skip=200))


@pl.function
def few_shot_mc(s, question):
    s += "Answer with the letter of the correct option.\n\n" + FEW_SHOT
    s += question + "\nAnswer: " + pl.select("answer", ["a", "b", "c", "d"])


@pl.function
def hellaswag_style(s, question, options):
    s += question.split("\n\n")[0] + "\nThe answer is: " + pl.select("answer", options)


@pl.function
def react(s, question):
    s += ("Use Search[term] to look things up and Finish[answer] to answer.\n"
          "Question: Where is the Louvre?\nThought 1: I should search for the Louvre.\nAction 1: Search[Louvre]\n"
          "Observation 1: The Louvre is a museum in Paris.\nThought 2: I know it now.\nAction 2: Finish[Paris]\n\n"
          f"Question: {question}\n")
    for step in range(1, 3):
        s += f"Thought {step}: I" + pl.gen(f"thought{step}", max_tokens=24, stop="\n", temperature=0) + "\n"
        s += f"Action {step}: " + pl.select(f"action{step}", ["Search", "Finish"]) + "["
        s += pl.gen(f"arg{step}", max_tokens=8, stop="]", temperature=0) + "]\n"
        if s[f"action{step}"] == "Finish":
            break
        s += f"Observation {step}: It is a well-known topic; the answer is in the first result.\n"


@pl.function
def tree_of_thought(s, question):
    s += pl.system("You are a careful problem solver. " + FEW_SHOT[:1500])
    s += pl.user(question)
    s += pl.assistant_begin()
    plans = s.fork(3)
    for i, p in enumerate(plans):
        p += f"Approach {i + 1}: you could" + pl.gen("plan", max_tokens=24, temperature=0.8, seed=i)
        p += "\nFirst step:" + pl.gen("step", max_tokens=24, temperature=0.8, seed=10 + i)
    plans.join()
    s += "The best approach is number " + pl.select("best", ["1", "2", "3"]) + "."
    s += pl.assistant_end()


SCHEMA = {"type": "object", "properties": {
    "subject": {"type": "string", "maxLength": 24}, "difficulty": {"enum": ["easy", "medium", "hard"]},
    "answer_letter": {"enum": ["a", "b", "c", "d"]}}, "required": ["subject", "difficulty", "answer_letter"]}


@pl.function
def json_decode(s, question):
    s += pl.user("Describe this exam question as JSON.\n" + question)
    s += pl.assistant(pl.gen("json", json_schema=SCHEMA, max_tokens=64, temperature=0))


@pl.function
def multi_turn(s, q1, q2, q3):
    s += pl.system("You are a helpful assistant.")
    for i, q in enumerate((q1, q2, q3)):
        s += pl.user(q)
        s += pl.assistant(pl.gen(f"a{i}", max_tokens=24, temperature=0))


def workloads(n: int) -> dict[str, tuple]:
    rows = mcq_rows(n)
    qs = [r["question"] for r in rows]
    return {
        "few-shot multiple choice (select)": (few_shot_mc, [{"question": q} for q in qs]),
        "HellaSwag-style (select over endings)": (hellaswag_style, [{"question": r["question"], "options": r["options"]}
                                                                    for r in rows]),
        "ReAct agent": (react, [{"question": q.split("\n")[2][:120]} for q in qs[: max(n // 2, 2)]]),
        "tree-of-thought (fork)": (tree_of_thought, [{"question": q.split("\n\n")[1][:200]} for q in qs[: max(n // 4, 2)]]),
        "JSON decoding (schema)": (json_decode, [{"question": q} for q in qs[: max(n // 2, 2)]]),
        "multi-turn chat": (multi_turn, [{"q1": q.split("\n\n")[1][:150], "q2": "Why?", "q3": "Summarize."}
                                         for q in qs[: max(n // 2, 2)]]),
    }


def cache_stats(states) -> tuple[int, int]:
    prompt = cached = 0
    for s in states:
        for meta in s.meta_info.values():
            for m in meta.get("branches", [meta]):
                prompt += m.get("prompt_tokens", 0)
                cached += m.get("cached_tokens", 0)
    return prompt, cached


def timed(func, args, backend):
    t0 = time.perf_counter()
    states = func.run_batch(args, backend=backend)
    return time.perf_counter() - t0, states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16, help="programs per select workload (others use fewer)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    cmd = "python benchmarks/bench_programs.py " + " ".join(sys.argv[1:])
    work = workloads(args.n)

    plait_rt = pl.Runtime(num_threads=args.threads, dtype="float32", log_level="warning", max_total_tokens=65536)
    plait_res = {}
    try:
        few_shot_mc.run(question="warm up", backend=plait_rt)  # compiles the C kernels
        plait_rt.engine.flush_cache()
        for name, (func, batch) in work.items():
            dt, states = timed(func, batch, plait_rt)
            plait_res[name] = (dt, cache_stats(states), states)
            print(f"plait {name}: {len(batch) / dt:.2f} programs/s", flush=True)
            plait_rt.engine.flush_cache()
    finally:
        plait_rt.shutdown()

    from naive_backend import TransformersBackend

    naive = TransformersBackend(args.threads)
    lines = [f"`{cmd}` (fp32, {args.threads} threads, default model)", "",
             "| workload | programs | plait programs/s | naive programs/s | ratio | plait cached / prompt tokens | same answers |",
             "|---|---|---|---|---|---|---|"]
    for name, (func, batch) in work.items():
        dt_n, states_n = timed(func, batch, naive)
        dt_p, (prompt, cached), states_p = plait_res[name]
        var = next(iter(states_p[0].variables))
        same = sum(a.variables.get(var) == b.variables.get(var) for a, b in zip(states_p, states_n))
        lines.append(f"| {name} | {len(batch)} | {len(batch) / dt_p:.2f} | {len(batch) / dt_n:.3f} | "
                     f"**{dt_n / dt_p:.1f}x** | {cached} / {prompt} ({cached / max(prompt, 1):.0%}) | {same}/{len(batch)} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if not args.no_save:
        save_results("programs.md", table)


if __name__ == "__main__":
    main()
