"""Where the benchmarks' tables go: benchmarks/results/, the files the README quotes."""

from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def save_results(name: str, text: str) -> None:
    """Write a benchmark's table (its command line first) to results/`name`."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name), "w") as f:
        f.write(text + "\n")
