"""Quickstart: a two-turn chat program.  python examples/quickstart.py [--url http://127.0.0.1:30000]"""

import plait as pl
from _common import backend_from_args


@pl.function
def multi_turn(s, q1, q2):
    s += pl.system("You are a helpful assistant.")
    s += pl.user(q1)
    s += pl.assistant(pl.gen("a1", max_tokens=48, temperature=0))
    s += pl.user(q2)
    s += pl.assistant(pl.gen("a2", max_tokens=48, temperature=0))


if __name__ == "__main__":
    backend = backend_from_args(__doc__)
    pl.set_default_backend(backend)
    s = multi_turn.run(q1="What is the capital of France?", q2="Name one famous museum there.")
    for m in s.messages():
        print(f"{m['role']:>9}: {m['content']}")
    backend.shutdown()
