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
