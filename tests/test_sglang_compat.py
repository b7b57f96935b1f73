"""SGLang programs run unchanged: SGLang's own `test/test_programs.py` (from the installed sglang
package, so the check follows SGLang, see tests/sglang_programs.py) on three pairings at once:

- the plait frontend (import changed) on `plait.Runtime` (ZMQ),
- the plait frontend on `plait.RuntimeEndpoint` against a plait server (in a subprocess, since a
  frontend has one default backend per process),
- SGLang's own frontend, unchanged, against the same plait server.

Every program that needs no image must run without a DSL or protocol failure; answer checks a
135M model fails are reported (as "answer"), not failed. The three run concurrently: the Runtime's
scheduler and the server's are separate processes (one core each), and the server batches its
two clients.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sglang_programs
from server_util import Server

import plait as pl
from conftest import THREADS

pytest.importorskip("sglang")


REMOTE_API_BACKENDS = {"Anthropic", "Crusoe", "LiteLLM", "VertexAI"}


def _public(tree: ast.Module, cls: str) -> set[str]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (not f.name.startswith("_") or f.name in ("__iadd__", "__getitem__", "__setitem__", "__contains__",
                                                          "__call__"))}


def test_every_public_name_and_method_of_sglang_lang_exists():
    """Read from the installed sglang's sources, so a new SGLang name fails here first."""
    root = sglang_programs.programs_file().parent.parent
    init = ast.parse((root / "__init__.py").read_text())
    names = next(ast.literal_eval(n.value) for n in init.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "__all__" for t in n.targets))
    missing = [n for n in names if n not in REMOTE_API_BACKENDS and not hasattr(pl, n)]
    assert not missing, missing
    interp = ast.parse((root / "lang" / "interpreter.py").read_text())
    ir = ast.parse((root / "lang" / "ir.py").read_text())
    for theirs, ours in ((_public(interp, "ProgramState"), pl.ProgramState),
                         (_public(interp, "ProgramStateGroup"), pl.ProgramStateGroup),
                         (_public(ir, "SglFunction"), pl.SglFunction)):
        assert theirs and not [m for m in theirs if not hasattr(ours, m)], (ours, theirs)
    regexes = {t.id for n in ir.body if isinstance(n, ast.Assign) for t in n.targets
               if getattr(t, "id", "").startswith("REGEX_")}
    assert regexes and all(hasattr(pl.lang.ir, r) for r in regexes)


@pytest.mark.slow  # 1.5-3 minutes (a server, a Runtime and SGLang's frontend at once): `make test-slow`
def test_sglang_test_programs_run_on_plait():
    results: dict[str, dict] = {}
    errors: list[BaseException] = []
    srv = Server("--max-total-tokens", "16384", "--enable-deterministic-inference")
    try:
        endpoint_run = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sglang_programs.py")),
                                         "--url", srv.url], stdout=subprocess.PIPE, text=True)

        def on_runtime() -> None:
            try:
                rt = pl.Runtime(num_threads=THREADS, max_total_tokens=16384, enable_deterministic_inference=True,
                                log_level="warning")
                try:
                    pl.set_default_backend(rt)
                    results["plait on Runtime"] = sglang_programs.run_all(sglang_programs.load("plait"), "plait")
                finally:
                    pl.global_config.default_backend = None
                    rt.shutdown()
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)

        def on_sglang_frontend() -> None:
            try:
                import sglang

                class LaunchedServer:  # what sglang.Runtime is to its frontend: a server plus its endpoint
                    endpoint = sglang.RuntimeEndpoint(srv.url)

                sglang.set_default_backend(LaunchedServer())
                results["sglang frontend on a plait server"] = sglang_programs.run_all(
                    sglang_programs.load("sglang"), "sglang")
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=on_runtime), threading.Thread(target=on_sglang_frontend)]
        for t in threads:
            t.start()
        out, _ = endpoint_run.communicate(timeout=1200)
        for t in threads:
            t.join()
        assert endpoint_run.returncode == 0, out[-2000:]
        results["plait on RuntimeEndpoint"] = json.loads(out.strip().splitlines()[-1])
        info = srv.client().get("/server_info").json()
    finally:
        srv.stop()
    if errors:
        raise errors[0]
    print("\n" + sglang_programs.table(results))
    expected = set(sglang_programs.names(sglang_programs.load("plait")))
    assert all(set(r) == expected for r in results.values()) and len(expected) >= 17
    failures = {(run, name): r["detail"] for run, rs in results.items() for name, r in rs.items()
                if r["outcome"] == "fail"}
    assert not failures, failures  # what is left: the model's answers, and SGLang's frontend's own limits
    assert info["kv_check"] == "ok" and info["num_failed"] == 0
