"""bench_peers' measurements of plait alone and of the machine: plait's weight variants offline (quality against
float32, batch-1 decode, a busy neighbour core), one decode step split by part against its roofline, and the
machine's read bandwidth and GEMM peak that the bounds use."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def read_bandwidth(threads: int) -> float:
    """This machine's read bandwidth in bytes/s with `threads` threads: the best of 5 sums over a 2 GB buffer."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(2**29, dtype=torch.float32)
        best = 1e9
        for _ in range(5):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return buf.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def decode_weight_bytes(gguf: str) -> int:
    """Bytes of weights one decode step reads: every tensor, less the token embedding where the LM head is its
    own tensor (a step looks up one row of it)."""
    from plait.runtime.model_loader.gguf_file import GGUFFile

    f = GGUFFile(gguf)
    untied = any(t.name == "output.weight" for t in f.tensors)
    return sum(t.nbytes for t in f.tensors if not (untied and t.name == "token_embd.weight"))


# ---- offline: quality and step breakdown of plait's weight variants ---------------------------
OFFLINE_ROUNDS = 4


def offline(ns, tok, prompts: list[str]) -> list[str]:
    """Batch-1 decode speed and quality against float32 for each variant, in one process."""
    import torch

    from plait.runtime.model_executor.model_runner import ModelRunner
    from plait.runtime.server_args import ServerArgs

    variants = {"default": {}, "none": {"quantization": "none"}, "float32": {"dtype": "float32", "quantization": "none"},
                "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}
    runners = {}
    for name, kw in variants.items():
        args = ServerArgs(num_threads=ns.threads, max_total_tokens=20000, max_running_requests=72, **kw).resolved()
        runners[name] = ModelRunner(args, progress=False)
        variants[name] = {"dtype": args.dtype, "quantization": args.quantization}
    ids = [tok.encode(p)[:200] for p in prompts]

    # float32's greedy continuations, then every variant's next-token distributions along them
    ref = runners["float32"]
    seqs = [_greedy(ref, p, 48) for p in ids]
    dists = {name: [_logprobs(r, p, s) for p, s in zip(ids, seqs)] for name, r in runners.items()}
    rows = []
    for name in runners:
        top1, kl, n = 0, 0.0, 0
        for lp, lq in zip(dists["float32"], dists[name]):
            top1 += int((lp.argmax(-1) == lq.argmax(-1)).sum())
            kl += float((lp.exp() * (lp - lq)).sum())
            n += lp.shape[0]
        rows.append((name, top1 / n, kl / n, n))
    speed, load = {name: [] for name in runners}, [os.getloadavg()[0]]
    # alternating rounds: this machine's memory bandwidth is shared and swings by a third within a
    # minute, so one round of each says little about their ratio
    for _ in range(OFFLINE_ROUNDS):
        for name, r in runners.items():
            speed[name].append(_decode_speed(r, ids[0][:127], 128))
    mean = {name: sum(v) / len(v) for name, v in speed.items()}
    load.append(os.getloadavg()[0])
    lines = ["**plait's weight variants, offline** (in-process ModelRunner, batch-1 decode after a 127-token prompt, "
             f"{ns.threads} threads; quality over {rows[0][3]} next-token distributions along float32's greedy "
             f"continuations of {len(ids)} prompts; 1-minute load average {load[0]:.1f} before the speed rounds, "
             f"{load[1]:.1f} after)", "",
             f"| variant | weights | batch-1 decode tok/s (mean; {OFFLINE_ROUNDS} rounds of 128 steps) | vs unquantized "
             "(none) | top-1 agreement with float32 | mean KL |",
             "|---|---|---|---|---|---|"]
    for name, top1, kl, _ in rows:
        v, rounds = variants[name], " / ".join(f"{x:.1f}" for x in speed[name])
        lines.append(f"| {name} | {v['dtype']}, quantization {v['quantization']} | {mean[name]:.1f} ({rounds}) | "
                     f"{mean[name] / mean['none']:.2f}x | "
                     f"{100 * top1:.2f}% | {kl:.5f} |")
    lines += ["", _neighbour(runners["default"], ids[0][:127], ns), "", *_breakdown(runners["default"], ids, ns)]
    del runners
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return lines


def _greedy(runner, prompt: list[int], n: int) -> list[int]:
    from plait.runtime.forward.batch import ForwardMode
    from plait.runtime.model_executor.model_runner import WorkItem

    row = _row(runner, len(prompt) + n)
    out: list[int] = []
    logits = runner.forward([WorkItem(row, 0, prompt, [len(prompt) - 1])]).logits
    for i in range(n):
        out.append(int(logits[0].argmax()))
        logits = runner.forward([WorkItem(row, len(prompt) + i, [out[-1]], [0], ForwardMode.DECODE)]).logits
    _free(runner, row, len(prompt) + n)
    return out


def _logprobs(runner, prompt: list[int], cont: list[int]):
    from plait.runtime.model_executor.model_runner import WorkItem

    seq = prompt + cont
    row = _row(runner, len(seq))
    logits = runner.forward([WorkItem(row, 0, seq, list(range(len(prompt) - 1, len(seq) - 1)))]).logits
    _free(runner, row, len(seq))
    return logits.float().log_softmax(-1)


def _row(runner, n: int) -> int:
    row = runner.req_to_token.alloc()
    runner.req_to_token.table[row, :n] = runner.allocator.alloc_pages(n)
    return row


def _free(runner, row: int, n: int) -> None:
    runner.allocator.free(runner.req_to_token.table[row, :n].clone())
    runner.req_to_token.free(row)


def _decode_speed(runner, prompt: list[int], steps: int) -> float:
    from plait.runtime.forward.batch import ForwardMode
    from plait.runtime.model_executor.model_runner import WorkItem

    row = _row(runner, len(prompt) + steps)
    runner.forward([WorkItem(row, 0, prompt, [len(prompt) - 1])])
    start = time.perf_counter()
    for i in range(steps):
        runner.forward([WorkItem(row, len(prompt) + i, [42], [0], ForwardMode.DECODE)])
    el = time.perf_counter() - start
    _free(runner, row, len(prompt) + steps)
    return steps / el


def _neighbour(runner, prompt: list[int], ns) -> str:
    """Batch-1 decode while another process keeps one core busy, with the thread governor and with a
    fixed thread count (runtime/model_executor/threads.py), next to the quiet figure."""
    from plait.runtime.model_executor.threads import ThreadGovernor

    steps = 512  # the governor probes every 128 decode steps
    quiet = _decode_speed(runner, prompt, steps)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1)
        runner.threads = None
        fixed = _decode_speed(runner, prompt, steps)
        runner.threads = ThreadGovernor(ns.threads)
        adaptive = _decode_speed(runner, prompt, steps)
    finally:
        busy.kill()
        runner.threads = ThreadGovernor(ns.threads)
    return ("**A busy neighbour** (default variant, batch-1 decode, 512 steps; another process spinning on one of "
            f"the cores): quiet {quiet:.1f} tok/s; busy with the thread governor (the default) {adaptive:.1f} tok/s "
            f"({adaptive / quiet:.2f}x of quiet); busy with `--thread-policy fixed` at {ns.threads} threads "
            f"{fixed:.1f} tok/s ({fixed / quiet:.2f}x)")


def gemm_peak(threads: int) -> tuple[float, str]:
    """This machine's GEMM peak in FLOP/s with `threads` threads, in the dtype plait's many-row matmuls use here
    (oneDNN over a packed copy, bfloat16 where the CPU multiplies it natively): the best of 5 on 2048 x 4096 x 2048."""
    import torch

    from plait.runtime.layers.linear import onednn_copy, onednn_linear, packed_dtype

    dtype = packed_dtype(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, x = onednn_copy(torch.randn(4096, 2048), dtype), torch.randn(2048, 2048).to(dtype)
        if w is None:
            return 0.0, str(dtype).removeprefix("torch.")
        best = 1e9
        for _ in range(6):
            start = time.perf_counter()
            onednn_linear(x, w, None)
            best = min(best, time.perf_counter() - start)
        return 2 * 2048 * 4096 * 2048 / best, str(dtype).removeprefix("torch.")
    finally:
        torch.set_num_threads(before)


def _matmul_params(model) -> int:
    """Weights a decode token multiplies by: every layer's matmuls and the LM head (not the embedding lookup)."""
    layers = sum(m.out_features * m.in_features for layer in model.layers for m in layer.linears())
    return layers + model.lm_head.out_features * model.lm_head.in_features


def _breakdown(runner, ids: list[list[int]], ns) -> list[str]:
    """Where a decode step's time goes at batch 1, 16 and 64, beside the roof: the split timed by wrapping the model's
    kernels in the Python layer loop, the step as served (decode steps of few rows run the layer stack as one C
    call), and the bound: bytes of weights over the measured read bandwidth or FLOPs over the measured GEMM peak,
    whichever is longer."""
    import torch

    import plait.runtime.layers.linear as layers
    import plait.runtime.models.llama as llama
    from plait.runtime.forward.batch import ForwardMode
    from plait.runtime.model_executor.model_runner import WorkItem
    from plait.runtime.sampling.params import SamplingParams
    from plait.runtime.sampling.sampler import SampleRow, sample
    from plait.runtime.server_args import default_model_path

    # the matmuls with what they fuse (the norms before QKV and gate/up, the activation before down_proj)
    parts = {"matmul": [(cls, n) for cls in (layers.QKVLinear, layers.MergedColumnLinear, layers.RowLinear)
                        for n in ("forward", "forward_normed", "forward_add_normed", "forward_act_mul")],
             "LM head": [(layers.VocabEmbedding, "forward")],
             "attention": [(llama, "paged_attention")],
             "other kernels": [(llama, n) for n in ("rms_norm", "rope_store")]}
    spent: dict[str, float] = {}
    originals = []

    def wrap(owner, attr: str, key: str):
        fn = getattr(owner, attr)
        originals.append((owner, attr, owner.__dict__.get(attr)))

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
        setattr(owner, attr, timed)

    bandwidth = read_bandwidth(ns.threads)
    peak, peak_dtype = gemm_peak(ns.threads)
    weight_bytes = decode_weight_bytes(default_model_path())
    flops_per_token = 2 * _matmul_params(runner.model)
    params = SamplingParams(temperature=0, max_new_tokens=1)
    gen = torch.Generator().manual_seed(0)
    graph, steps = runner.model.graph, 10
    stack = getattr(graph, "stack", None)
    rows_out = []
    # every step on all the threads: the thread governor's probes (a few steps on one thread fewer) would land in
    # some rows and not others
    governor, runner.threads = runner.threads, None
    for batch in (1, 16, 64):
        rows = []
        for b in range(batch):
            p = ids[b % len(ids)]
            rows.append((_row(runner, len(p) + 3 * steps), len(p)))
            runner.forward([WorkItem(rows[-1][0], 0, p, [len(p) - 1])])

        def step(s: int) -> tuple[float, float, float]:
            items = [WorkItem(row, n + s, [42], [0], ForwardMode.DECODE) for row, n in rows]
            t0 = time.perf_counter()
            runner.build_batch(items)
            t1 = time.perf_counter()
            logits = runner.forward(items).logits
            t2 = time.perf_counter()
            sample(logits, [SampleRow(params, gen, [], [], [], False, 0) for _ in items])
            return t1 - t0, t2 - t1, time.perf_counter() - t2

        step(2 * steps)  # a first step of a new batch shape allocates: not counted
        # as served: the C stack where it takes the batch
        served = sum(sum(step(s)) for s in range(steps))
        # the split, in the loop
        runner.model.graph = None
        for key, targets in parts.items():
            for owner, attr in targets:
                wrap(owner, attr, key)
        spent.clear()
        try:
            meta = total = samp = 0.0
            for s in range(steps, 2 * steps):
                m, f, a = step(s)
                meta, total, samp = meta + m, total + f, samp + a
        finally:
            runner.model.graph = graph
            for owner, attr, fn in reversed(originals):
                if fn is None:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, fn)
            originals.clear()
        for row, n in rows:
            _free(runner, row, n + 3 * steps)
        inner = sum(spent.values())
        bound = max(weight_bytes / bandwidth, batch * flops_per_token / peak if peak else 0.0)
        kind = "bandwidth" if weight_bytes / bandwidth >= (batch * flops_per_token / peak if peak else 0) else "GEMM"
        ms = lambda x: f"{1000 * x / steps:.2f}"  # noqa: E731
        rows_out.append(
            f"| {batch} | {ms(served)} | {ms(total + meta + samp)} | {ms(spent.get('matmul', 0))} | "
            f"{ms(spent.get('LM head', 0))} | {ms(spent.get('attention', 0))} | {ms(spent.get('other kernels', 0))} | "
            f"{ms(total - inner)} | {ms(meta)} | {ms(samp)} | {1000 * bound:.2f} ({kind}) | "
            f"{100 * bound * steps / served:.0f}% |")
    runner.threads = governor
    where = ("nowhere" if stack is None else "for every decode batch" if stack.max_rows >= 1 << 20
             else f"where the batch has at most {stack.max_rows} rows")
    return ["**One decode step against the roof** (default variant, prompts of ~200 tokens, ms per step; `served`: "
            f"as the server runs it, the layer stack as one C call {where}; the split is timed in the Python layer "
            "loop; the "
            f"bound is the longer of {weight_bytes / 1e6:.0f} MB of weights over the read bandwidth "
            f"({bandwidth / 1e9:.1f} GB/s, {ns.threads} threads) and {flops_per_token / 1e9:.2f} GFLOP a token over "
            f"the GEMM peak ({peak / 1e9:.0f} GFLOP/s, oneDNN {peak_dtype} 2048 x 4096 x 2048), and the last column "
            "the bound's share of the served step)", "",
            "| batch | step, served | step, loop | matmul (with the norms and activation it fuses) | LM head | attention "
            "| other kernels | glue | batch metadata | sampling | bound | served at |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows_out]


