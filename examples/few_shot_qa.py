"""Few-shot QA over a batch: the shared examples are computed once (run_batch traces the program's
constant prefix and caches it), then every question reads them from the radix cache."""

import plait as pl
from _common import backend_from_args

EXAMPLES = [("What is the capital of Italy?", "Rome"), ("How many legs does a spider have?", "Eight"),
            ("What color is grass?", "Green"), ("Who wrote Romeo and Juliet?", "William Shakespeare")]


@pl.function
def few_shot_qa(s, question):
    s += "Answer each question briefly.\n\n"
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + pl.gen("answer", max_tokens=12, stop="\n", temperature=0)


if __name__ == "__main__":
    backend = backend_from_args(__doc__)
    questions = ["What is the capital of France?", "How many days are in a week?", "What is the largest ocean?",
                 "What do bees make?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend)
    for q, s in zip(questions, states):
        meta = s.get_meta_info("answer")
        print(f"{q} -> {s['answer'].strip()}   (prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} cached)")
    backend.shutdown()
