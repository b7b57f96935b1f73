"""Parallel document summaries: one program per document with run_batch (the shared instruction
is cached once), then one more program that merges the summaries."""

import plait as pl
from _common import backend_from_args

DOCS = [
    "The city council approved a new bike lane network covering 40 km of streets, to be built over three years. "
    "Supporters expect fewer accidents; some shop owners worry about parking.",
    "A local bakery won a national award for its sourdough bread. The owners started the business in a garage "
    "ten years ago and now employ 25 people.",
    "Heavy rain flooded the riverside park on Tuesday. Crews reopened the main paths by Thursday, but the "
    "playground stays closed for repairs.",
]


@pl.function
def summarize(s, doc):
    s += pl.system("You write one-sentence news summaries.")
    s += pl.user("Summarize in one sentence:\n" + doc)
    s += pl.assistant(pl.gen("summary", max_tokens=40, stop="\n", temperature=0))


@pl.function
def headline(s, summaries):
    s += pl.user("Write a headline covering these stories:\n" + "\n".join(f"- {x}" for x in summaries))
    s += pl.assistant(pl.gen("headline", max_tokens=20, stop="\n", temperature=0))


if __name__ == "__main__":
    backend = backend_from_args(__doc__)
    states = summarize.run_batch([{"doc": d} for d in DOCS], backend=backend)
    summaries = [s["summary"].strip() for s in states]
    for x in summaries:
        print("-", x)
    print("headline:", headline.run(summaries=summaries, backend=backend)["headline"].strip())
    backend.shutdown()
