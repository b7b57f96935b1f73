"""Plots of the benchmarks' tables: each results/NAME.md table that has a spec below becomes docs/img/NAME.png.

The plots are drawn from the markdown tables the benchmarks write (results/), so the numbers in a plot are the
numbers in its table; `report.save_results` draws a benchmark's plot as it saves the table.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

IMG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img")


@dataclass(frozen=True)
class Plot:
    title: str
    labels: tuple[str, ...]  # the columns that name a row (joined with " / ")
    values: str  # a regex: the columns plotted, one bar series each
    ylabel: str
    keep: dict[str, str] = field(default_factory=dict)  # column -> regex its cell must match (rows kept)
    log: bool = False
    one: bool = False  # a line at 1.0 (ratios)


_PEERS = Plot("plait against its peers, same workloads in alternating rounds", ("workload",),
              r"^plait / ", "ratio (higher: plait faster)", one=True)
_SPECULATIVE = Plot("Speculative decoding: speed-up over no drafts", ("workload", "batch"), r"^speed-up$",
                    "speed-up", one=True)
SPECS: dict[str, Plot] = {
    "peers.md": _PEERS,
    "models.md": Plot("Batch-1 decode against the bandwidth bound", ("model",),
                      r"^(batch-1 decode tok/s|bound tok/s)", "tokens/s"),
    "serving.md": Plot("Online serving: plait over transformers", ("workload",), r"^(req/s|out tok/s)$",
                       "ratio", keep={"server": "ratio"}, one=True),
    "offline.md": Plot("Offline throughput against transformers", ("workload",), r"^ratio$", "ratio", one=True),
    "programs.md": Plot("Prompt programs: plait over a naive backend", ("workload",), r"^ratio$", "ratio",
                        one=True),
    "speculative.md": _SPECULATIVE,
    "speculative_agent.md": _SPECULATIVE,
    "speculative_standalone.md": _SPECULATIVE,
    "window_kv.md": Plot("Sliding-window layers keeping only their window", ("sliding-window layers keep",),
                         r"^output tok/s$", "output tokens/s"),
    "parallel.md": Plot("Parallel layouts on one machine", ("layout",), r"concurrent$", "output tokens/s"),
    "moe.md": Plot("MoE layer: plait over a per-expert loop", ("dtype", "tokens"), r"^speedup$", "speed-up",
                   one=True),
    "structured.md": Plot("Grammar compile time over the schema corpus", ("backend",),
                          r"^compile p(50|99) ms$", "ms (log)", log=True),
}


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table in `text`: (header cells, rows of cells)."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1].strip()):
            header = _cells(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append((header, rows))
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def number(cell: str) -> float | None:
    """The first number in a cell ("135.26 tok/s (...)", "4.47x", "**2.08x**", "1,811"), or None."""
    m = re.search(r"-?\d[\d,]*\.?\d*", cell.replace("**", ""))
    return float(m.group().replace(",", "")) if m else None


def series(spec: Plot, text: str) -> tuple[list[str], dict[str, list[float]]] | None:
    """(row labels, column -> values) of the first table that has the spec's columns."""
    for header, rows in tables(text):
        cols = [i for i, h in enumerate(header) if re.search(spec.values, h)]
        if not cols or not all(lab in header for lab in spec.labels):
            continue
        keep = [r for r in rows if len(r) == len(header)
                and all(re.search(rx, r[header.index(c)]) for c, rx in spec.keep.items())]
        labels = [" / ".join(r[header.index(lab)] for lab in spec.labels)[:40] for r in keep]
        named: dict[str, list[float]] = {}
        for n, i in enumerate(cols):
            values = [number(r[i]) for r in keep]
            if all(v is not None for v in values):
                # a repeated name (a speed-up per algorithm) takes the name of the column before its group
                name = header[i] if header.count(header[i]) == 1 else _group_name(header, i, n)
                named[name] = values
        if labels and named:
            return labels, named
    return None


def _group_name(header: list[str], i: int, n: int) -> str:
    before = [h for h in header[:i] if h.startswith("tok/s ") and h != "tok/s off"]
    return before[-1][len("tok/s "):] if before else f"{header[i]} {n + 1}"


def plot(name: str, text: str, out_dir: str = IMG) -> str | None:
    """Draw results/`name`'s plot into out_dir; returns its path (None: no spec, no data or no matplotlib)."""
    spec = SPECS.get(name) or (_PEERS if name.startswith("peers-") else None)  # a model's run, per CPU level
    data = series(spec, text) if spec else None
    if data is None:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot drawn")
        return None
    labels, named = data
    width = 0.8 / len(named)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 3.6))
    for k, (col, values) in enumerate(named.items()):
        ax.bar([x + (k - (len(named) - 1) / 2) * width for x in range(len(labels))], values, width, label=col)
    if spec.one:
        ax.axhline(1.0, color="grey", linewidth=0.8)
    if spec.log:
        ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(spec.ylabel)
    ax.set_title(spec.title, fontsize=10)
    if len(named) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, os.path.splitext(name)[0] + ".png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
