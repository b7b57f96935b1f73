"""A ReAct-style agent: the model thinks, then picks its next action with select (scored in one
batched prefill call), and the program runs the tool it chose."""

import plait as pl
from _common import backend_from_args

FACTS = {"france": "France's capital is Paris; its population is about 68 million.",
         "eiffel tower": "The Eiffel Tower is 330 metres tall and was finished in 1889."}


def search(term: str) -> str:
    for key, fact in FACTS.items():
        if key in term.lower():
            return fact
    return "No results."


def calculate(expr: str) -> str:
    allowed = set("0123456789+-*/(). ")
    return str(eval(expr)) if expr and set(expr) <= allowed else "Cannot calculate that."  # noqa: S307


@pl.function
def react(s, question, max_steps=3):
    s += ("Solve the question with these tools: Search[term] looks something up, Calculate[expression] does "
          "arithmetic, Finish[answer] gives the answer.\n"
          "Question: How tall is the Eiffel Tower in centimetres?\n"
          "Thought 1: I need the height of the Eiffel Tower.\nAction 1: Search[Eiffel Tower]\n"
          "Observation 1: The Eiffel Tower is 330 metres tall.\n"
          "Thought 2: 330 metres is 330*100 centimetres.\nAction 2: Calculate[330*100]\nObservation 2: 33000\n"
          "Thought 3: I have the answer.\nAction 3: Finish[33000 centimetres]\n\n"
          f"Question: {question}\n")
    for step in range(1, max_steps + 1):
        s += f"Thought {step}: I" + pl.gen(f"thought{step}", max_tokens=32, stop="\n", temperature=0) + "\n"
        s += f"Action {step}: " + pl.select(f"action{step}", ["Search", "Calculate", "Finish"]) + "["
        s += pl.gen(f"arg{step}", max_tokens=16, stop="]", temperature=0) + "]\n"
        action, arg = s[f"action{step}"], s[f"arg{step}"]
        if action == "Finish":
            break
        s += f"Observation {step}: {search(arg) if action == 'Search' else calculate(arg)}\n"


if __name__ == "__main__":
    backend = backend_from_args(__doc__)
    s = react.run(question="What is the capital of France?", backend=backend)
    print(s.text().split("\n\n")[-1])
    backend.shutdown()
