"""Reliability runs against the real server (`make test-reliability`; a reduced load run is in the
default tests as tests/test_reliability.py). Each phase starts its own server on a free loopback
port and prints its figures:

- load:    N requests at C concurrent (mixed lengths; streaming and not; native, chat and completions;
           10% of clients hang up mid-request, 5% abort by rid): lost, 5xx, outcomes, KV consistent after;
- tiny-kv: a KV pool far too small for the load: every request retracted and resumed, none lost,
           greedy outputs equal a roomy server's (float32);
- kill:    SIGKILL the scheduler, then (another server) the detokenizer, with requests in flight:
           when every in-flight request ended, when the server exited and with what code;
- signals: SIGTERM to the server, SIGINT and SIGTERM to its process group, 16 requests in flight each
           time: they finish, exit code 0;
- slow-clients: 200 idle, slow-header and slow-body connections beside normal requests: each answered
           408 and closed within its timeout, the others served;
- soak:    steady load for M minutes, the scheduler's resident memory sampled every 10 s: the curve
           and its slope over the part after the KV pool filled.

    python tests/reliability.py [--phases load,tiny-kv,kill,signals,slow-clients,soak] [--requests 2000]
        [--concurrency 64] [--soak-minutes 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from server_util import Server, slow_connection

PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about rain.",
           "Why is the sky blue?", "Explain what a CPU does in one paragraph.", "List five fruits.",
           "Tell me a story about a dragon who learns to fly.", "Translate 'good morning' into Spanish.",
           "What is 12 times 12?", "Give me three tips for sleeping well."]


@dataclass
class LoadReport:
    outcomes: Counter = field(default_factory=Counter)
    lost: int = 0
    server_errors: int = 0
    unexpected_4xx: int = 0
    seconds: float = 0.0
    kv_check: str = ""
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.server_errors == 0 and self.unexpected_4xx == 0 and self.kv_check == "ok"

    def summary(self) -> str:
        return (f"{sum(self.outcomes.values())} requests in {self.seconds:.1f} s: lost {self.lost}, 5xx "
                f"{self.server_errors}, unexpected 4xx {self.unexpected_4xx}, kv_check {self.kv_check}; outcomes "
                + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())))


def _prompt(rng: random.Random) -> str:
    text = rng.choice(PROMPTS)
    return text + (" Please answer in detail." * rng.randint(0, 12))


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int, report: LoadReport) -> None:
    kind = rng.choice(["native", "native-stream", "chat", "chat-stream", "completions"])
    max_new = rng.choice([1, 4, 16, 32, 64])
    behaviour = rng.choices(["normal", "disconnect", "abort"], weights=[85, 10, 5])[0]
    if behaviour == "abort":
        kind = rng.choice(["native", "native-stream"])  # aborts go by rid, a native field
    rid = f"rel-{i}-{rng.getrandbits(32):x}"
    temp = rng.choice([0, 0.7])
    if kind.startswith("native"):
        path = "/generate"
        body = {"text": _prompt(rng), "rid": rid, "stream": kind.endswith("stream"),
                "sampling_params": {"max_new_tokens": max_new, "temperature": temp}}
    elif kind.startswith("chat"):
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": _prompt(rng)}], "max_tokens": max_new,
                "temperature": temp, "stream": kind.endswith("stream")}
    else:
        path = "/v1/completions"
        body = {"prompt": _prompt(rng), "max_tokens": max_new, "temperature": temp, "n": rng.choice([1, 2])}
    stream = bool(body.get("stream"))
    try:
        if behaviour == "abort":
            async def abort_later():
                await asyncio.sleep(rng.uniform(0.1, 1.0))
                await client.post("/abort_request", json={"rid": rid})

            aborter = asyncio.ensure_future(abort_later())  # noqa: F841 - held: a bare task may be collected
        if stream:
            done = False
            events = 0
            async with client.stream("POST", path, json=body) as r:
                if r.status_code >= 500:
                    report.server_errors += 1
                    report.problems.append(f"{path}: {r.status_code}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events += 1
                    if line == "data: [DONE]":
                        done = True
                    elif '"error"' in line[:20]:
                        err = json.loads(line[6:])["error"]
                        if err["code"] >= 500:
                            report.server_errors += 1
                            report.problems.append(f"{path} stream: {err}")
                    if behaviour == "disconnect" and events >= 2:
                        report.outcomes["disconnected"] += 1
                        return  # leaving the context manager closes the connection mid-stream
            report.outcomes["aborted" if behaviour == "abort" else "ok" if done else "truncated"] += 1
            if not done:
                report.lost += 1
                report.problems.append(f"{path} stream ended without [DONE]")
        else:
            timeout = rng.uniform(0.3, 1.5) if behaviour == "disconnect" else 300
            try:
                r = await client.post(path, json=body, timeout=timeout)
            except httpx.TimeoutException:
                if behaviour == "disconnect":
                    report.outcomes["disconnected"] += 1
                    return
                raise
            if r.status_code >= 500:
                report.server_errors += 1
                report.problems.append(f"{path}: {r.status_code} {r.text[:200]}")
            elif r.status_code >= 400:
                report.unexpected_4xx += 1
                report.problems.append(f"{path}: {r.status_code} {r.text[:200]}")
            else:
                report.outcomes["aborted" if behaviour == "abort" else "ok"] += 1
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        report.lost += 1
        report.problems.append(f"{path}: {type(e).__name__}: {e}")


async def run_load(url: str, headers: dict, requests: int, concurrency: int, seed: int = 0) -> LoadReport:
    report = LoadReport()
    rng = random.Random(seed)
    seeds = [rng.getrandbits(32) for _ in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as client:
        async def worker():
            while not queue.empty():
                i = queue.get_nowait()
                await _one(client, random.Random(seeds[i]), i, report)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        report.seconds = time.perf_counter() - start
        report.kv_check = await _settled_kv_check(client)
    return report


async def _settled_kv_check(client: httpx.AsyncClient, timeout: float = 60) -> str:
    """Wait until nothing runs, flush the cache, and read the scheduler's own KV consistency check."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = (await client.get("/server_info")).json()
        if info["num_running"] == 0 and info["num_waiting"] == 0 and info["kv_check"] is not None:
            break
        await asyncio.sleep(0.25)
    else:
        return f"still busy after {timeout:g} s: {info['num_running']} running, {info['num_waiting']} waiting"
    await client.post("/flush_cache")
    return (await client.get("/server_info")).json()["kv_check"]


# ---- phases -----------------------------------------------------------------------------------
def phase_load(a) -> bool:
    srv = Server("--max-total-tokens", "32768", "--max-running-requests", str(a.concurrency), "--num-threads",
                 str(a.threads))
    try:
        report = asyncio.run(run_load(srv.url, srv.headers, a.requests, a.concurrency))
    finally:
        code = srv.stop()
    print(f"load: {a.requests} requests at {a.concurrency} concurrent: {report.summary()}; exit {code}")
    for p in report.problems[:10]:
        print("   ", p)
    return report.ok and code == 0


async def _greedy_outputs(url: str, n: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i: int):
            r = await client.post("/generate", json={"text": PROMPTS[i % len(PROMPTS)] + f" ({i})",
                                                     "sampling_params": {"max_new_tokens": 96, "temperature": 0,
                                                                         "ignore_eos": True}})
            r.raise_for_status()
            return r.json()["output_ids"]

        return await asyncio.gather(*(one(i) for i in range(n)))


def phase_tiny_kv(a) -> bool:
    n = 32
    outs = {}
    retracted = 0
    for name, tokens in (("roomy", "32768"), ("tiny", "320")):  # 320 tokens: about 3 of the 32 at full length
        # batch-invariant kernels: a retracted and recomputed request must give the same tokens in any dtype
        srv = Server("--max-total-tokens", tokens, "--enable-deterministic-inference", "--num-threads", str(a.threads))
        try:
            t = time.perf_counter()
            outs[name] = asyncio.run(_greedy_outputs(srv.url, n))
            secs = time.perf_counter() - t
            info = httpx.get(srv.url + "/server_info").json()
            if name == "tiny":
                retracted = info["num_retracted"]
            print(f"tiny-kv: {name} pool of {tokens} tokens: {n} requests in {secs:.1f} s, "
                  f"{info['num_retracted']} retractions")
        finally:
            srv.stop()
    same = sum(x == y for x, y in zip(outs["roomy"], outs["tiny"]))
    print(f"tiny-kv: {same}/{n} greedy outputs equal the roomy run's; {retracted} retractions")
    return same == n and retracted > 0


def phase_kill(a) -> bool:
    ok = True
    for victim in ("scheduler", "detokenizer"):
        srv = Server("--max-total-tokens", "8192", "--num-threads", str(a.threads))
        pids = httpx.get(srv.url + "/server_info").json()["pids"]
        ends: list[float] = []

        async def inflight():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                async def stream():
                    async with client.stream("POST", "/generate", json={"text": "A long story", "stream": True,
                                             "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}) as r:
                        async for _ in r.aiter_lines():
                            pass
                    ends.append(time.perf_counter())

                async def plain():
                    await client.post("/generate", json={"text": "A long story", "sampling_params": {
                        "max_new_tokens": 4000, "ignore_eos": True}})
                    ends.append(time.perf_counter())

                tasks = [asyncio.ensure_future(f()) for f in [stream, plain] * 4]
                await asyncio.sleep(2.0)
                os.kill(pids[victim], signal.SIGKILL)
                killed = time.perf_counter()
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
                return killed

        killed = asyncio.run(inflight())
        try:
            code = srv.proc.wait(30)
        except Exception:  # noqa: BLE001
            code = None
        exited = time.perf_counter() - killed
        last = max(ends) - killed if len(ends) == 8 else float("inf")
        print(f"kill {victim}: 8 in-flight requests ended within {last:.2f} s; server exited with code {code} "
              f"after {exited:.2f} s")
        ok &= last <= 2 and code not in (0, None) and exited <= 5
        if srv.proc.poll() is None:
            srv.proc.kill()
    return ok


def phase_signals(a) -> bool:
    """SIGTERM to the server alone, then SIGINT and SIGTERM to its whole process group (Ctrl+C, `timeout`,
    `systemctl stop`), each with 16 requests in flight: all complete, exit 0."""
    ok = True
    for sig, group in ((signal.SIGTERM, False), (signal.SIGINT, True), (signal.SIGTERM, True)):
        srv = Server("--max-total-tokens", "8192", "--num-threads", str(a.threads), "--shutdown-timeout", "60")

        async def inflight():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                tasks = [asyncio.ensure_future(client.post("/generate", json={
                    "text": PROMPTS[i % len(PROMPTS)], "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}))
                    for i in range(16)]
                await asyncio.sleep(1.0)
                if group:
                    os.killpg(srv.proc.pid, sig)
                else:
                    srv.proc.send_signal(sig)
                return await asyncio.gather(*tasks, return_exceptions=True)

        t = time.perf_counter()
        results = asyncio.run(inflight())
        code = srv.proc.wait(90)
        done = sum(1 for r in results if isinstance(r, httpx.Response) and r.status_code == 200
                   and r.json()["meta_info"]["completion_tokens"] == 48)
        to = "the process group" if group else "the server alone"
        print(f"signals: {signal.Signals(sig).name} to {to}: {done}/16 in-flight requests completed in full; "
              f"exit code {code} after {time.perf_counter() - t:.1f} s")
        ok &= done == 16 and code == 0
    return ok


def phase_slow_clients(a) -> bool:
    """200 connections held open by slow or idle clients (70 idle, 65 slow headers, 65 slow bodies) with the
    default timeouts, while normal requests go on: each slow one gets a 408 and is closed within its timeout."""
    srv = Server("--max-total-tokens", "8192", "--num-threads", str(a.threads))
    # 234 bytes at 2 a second: a slow body would take 117 s, past --body-timeout
    body = json.dumps({"text": "hi " * 60, "sampling_params": {"max_new_tokens": 2}}).encode()
    kinds = ["idle"] * 70 + ["headers"] * 65 + ["body"] * 65
    limits = {"idle": 10.0, "headers": 10.0, "body": 60.0}  # --header-timeout, --body-timeout (defaults)

    async def run():
        held = [asyncio.ensure_future(slow_connection(srv.port, kind, body, 120)) for kind in kinds]
        served, latencies = [], []
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            while not all(h.done() for h in held):
                t = time.perf_counter()
                r = await client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 8}})
                served.append(r.status_code)
                latencies.append(time.perf_counter() - t)
                await asyncio.sleep(0.5)
        return await asyncio.gather(*held), served, latencies

    results, served, latencies = asyncio.run(run())
    code = srv.stop()
    ok = served and all(c == 200 for c in served) and code == 0
    for kind in ("idle", "headers", "body"):
        mine = [r for k, r in zip(kinds, results) if k == kind]
        closed_408 = sum(1 for _, ans in mine if ans.startswith(b"HTTP/1.1 408"))
        worst = max(sec for sec, _ in mine)
        print(f"slow-clients: {len(mine)} {kind}: {closed_408} answered 408 and closed; the last after {worst:.1f} s "
              f"(timeout {limits[kind]:g} s)")
        ok &= closed_408 == len(mine) and worst < limits[kind] + 2
    print(f"slow-clients: {len(served)} normal requests meanwhile, all 200: {all(c == 200 for c in served)}; "
          f"latency max {max(latencies):.2f} s; exit {code}")
    return ok


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def phase_soak(a) -> bool:
    srv = Server("--max-total-tokens", "16384", "--num-threads", str(a.threads))
    pids = httpx.get(srv.url + "/server_info").json()["pids"]  # every process: server, scheduler, detokenizer
    names = sorted(pids, key=lambda n: (n != "server", n))
    samples: list[tuple[float, dict[str, float]]] = []
    stop_at = time.perf_counter() + a.soak_minutes * 60

    async def soak():
        report = LoadReport()
        rng = random.Random(1)
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
            async def worker():
                i = 0
                while time.perf_counter() < stop_at:
                    i += 1
                    await _one(client, random.Random(rng.getrandbits(32)), i, report)

            async def sampler():
                t0 = time.perf_counter()
                while time.perf_counter() < stop_at:
                    samples.append((time.perf_counter() - t0, {n: _rss_mib(pids[n]) for n in names}))
                    await asyncio.sleep(10)

            t0 = time.perf_counter()
            await asyncio.gather(sampler(), *(worker() for _ in range(16)))
            report.seconds = time.perf_counter() - t0
            report.kv_check = await _settled_kv_check(client)
        return report

    report = asyncio.run(soak())
    code = srv.stop()
    print(f"soak: {a.soak_minutes:g} min at 16 concurrent: {report.summary()}; exit {code}")
    print("soak: minute  " + "  ".join(f"{n} RSS MiB" for n in names))
    for t, rss in samples[:: max(1, len(samples) // 40)]:
        print(f"soak: {t / 60:6.1f}  " + "  ".join(f"{rss[n]:{len(n) + 8}.1f}" for n in names))
    tail = samples[len(samples) // 4:]  # after the KV pool and caches filled
    slopes = {n: _slope([(t / 60, rss[n]) for t, rss in tail]) for n in names}
    span = (tail[-1][0] - tail[0][0]) / 60 if len(tail) > 1 else 0
    print(f"soak: RSS slope over the last {span:.1f} min: "
          + ", ".join(f"{n} {v:+.2f} MiB/min" for n, v in slopes.items()))
    return report.ok and all(v < 1.0 for v in slopes.values())  # growth fails; a shrinking process does not


def _slope(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


PHASES = {"load": phase_load, "tiny-kv": phase_tiny_kv, "kill": phase_kill, "signals": phase_signals,
          "slow-clients": phase_slow_clients, "soak": phase_soak}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--soak-minutes", type=float, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    print(f"command: python tests/reliability.py {' '.join(sys.argv[1:])}; load average {os.getloadavg()[0]:.2f}")
    results = {}
    for name in a.phases.split(","):
        results[name] = PHASES[name](a)
    print("result: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
