"""The layers' import contracts, read from the source (every import counts: module level, in functions, and
under TYPE_CHECKING, since an annotation is a dependency too):

- the runtime never imports the DSL;
- radix_cache and kernels import nothing of the runtime, the DSL or the front door;
- the DSL reaches the runtime only through its client API (the Engine), and nothing below it;
- no cycle between the runtime's packages (a top-level module such as server_args counts as one).
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
# distribution package -> source folder (pyproject's package-dir)
FOLDERS = {"plait.lang": "lang", "plait.runtime": "runtime", "plait.radix_cache": "radix_cache",
           "plait.kernels": "kernels", "plait": "plait"}
DSL_CLIENT_API = {"plait.runtime.entrypoints.engine"}


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    package = next(p for p, folder in FOLDERS.items() if rel.parts[0] == folder)
    parts = [package, *rel.with_suffix("").parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """The plait names `path` imports: modules, and `module.name` for each name taken from one."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import (the source imports absolutely)"
            name = node.module or ""
            # `from pkg import mod` imports pkg.mod where mod is a module
            out |= {f"{name}.{a.name}" for a in node.names} | {name}
            if name.startswith("plait.") and name not in _MODULES:
                MISSING.add(f"{path.relative_to(ROOT)}: {name}")
    return {name for name in out if name == "plait" or name.startswith("plait.")}


MISSING: set[str] = set()  # modules imported that the source does not have
_MODULES = {_module_of(p): p for folder in FOLDERS.values() for p in (ROOT / folder).rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in _MODULES.items():
        # keep only names that are modules (or packages) of the source: `from x import a_function` names x
        graph[module] = {_nearest(name, _MODULES) for name in _imports(path, module)} - {None, module}
    return graph


def _nearest(name: str, modules: dict) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


GRAPH = _graph()


def _edges(src_prefix: str, dst_prefixes: tuple[str, ...]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in GRAPH.items() if _under(a, src_prefix)
                  for b in bs if any(_under(b, d) for d in dst_prefixes))


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_sees_the_source():
    assert "plait.runtime.scheduler.scheduler" in GRAPH
    assert "plait.runtime.ipc.messages" in GRAPH["plait.runtime.scheduler.scheduler"]
    assert MISSING == set()


def test_runtime_never_imports_the_dsl():
    assert _edges("plait.runtime", ("plait.lang",)) == []


def test_radix_cache_and_kernels_stand_alone():
    upper = ("plait.runtime", "plait.lang", "plait.cli", "plait.chat", "plait.bench", "plait.train_eagle")
    assert _edges("plait.radix_cache", upper) == []
    assert _edges("plait.kernels", (*upper, "plait.radix_cache")) == []


def test_the_dsl_reaches_the_runtime_only_through_its_client_api():
    reached = _edges("plait.lang", ("plait.runtime", "plait.radix_cache", "plait.kernels"))
    assert [e for e in reached if e.split(" -> ")[1] not in DSL_CLIENT_API] == []


def _package(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["plait", "runtime"] and len(parts) > 2 else None


def test_no_cycle_between_the_runtime_packages():
    packages: dict[str, set[str]] = {}
    why = {}
    for a, bs in GRAPH.items():
        for b in bs:
            pa, pb = _package(a), _package(b)
            if pa and pb and pa != pb:
                packages.setdefault(pa, set()).add(pb)
                why.setdefault((pa, pb), f"{a} -> {b}")
    try:
        graphlib.TopologicalSorter(packages).prepare()
    except graphlib.CycleError as e:
        cycle = e.args[1]  # [p0, p1, ..., p0], each importing the next's... reversed: graphlib lists predecessors
        raise AssertionError("a cycle: " + "; ".join(why.get((a, b)) or why[(b, a)] for a, b in zip(cycle, cycle[1:])))
