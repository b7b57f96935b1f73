"""Tree-of-thought with fork: several lines of reasoning grow from one shared prompt (sent once,
so every branch reads it from the radix cache; the branches decode together as one batch), then
the program asks the model which one to keep."""

import plait as pl
from _common import backend_from_args


@pl.function
def tree_of_thought(s, question, width=3):
    s += pl.system("You think step by step.")
    s += pl.user(question)
    s += pl.assistant_begin()
    plans = s.fork(width)
    for i, p in enumerate(plans):
        p += f"Approach {i + 1}: you could" + pl.gen("plan", max_tokens=32, stop="\n", temperature=0.8, seed=i) + "\n"
        p += "First step: " + pl.gen("step", max_tokens=32, stop="\n", temperature=0.8, seed=10 + i, min_tokens=4)
    plans.join()
    for i, (plan, step) in enumerate(zip(s["plan"], s["step"])):
        s += f"Approach {i + 1}: you could {plan.strip()} First step: {step.strip()}\n"
    s += "The best approach is number " + pl.select("best", [str(i + 1) for i in range(width)]) + ".\n"
    s += "Here is how to start: " + pl.gen("answer", max_tokens=48, stop="\n\n", temperature=0)
    s += pl.assistant_end()


if __name__ == "__main__":
    backend = backend_from_args(__doc__)
    s = tree_of_thought.run(question="How can I get better at remembering names?", backend=backend)
    for i, plan in enumerate(s["plan"]):
        print(f"approach {i + 1}: you could {plan.strip()}")
    print("chosen:", s["best"])
    print("answer:", s["answer"].strip())
    backend.shutdown()
