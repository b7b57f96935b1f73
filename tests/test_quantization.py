"""Block-quantized weights: the kernel against its reference on this ISA level for every block format
(Q8_0, Q4_1, Q5_0 and the super-block formats Q4_K, Q5_K, Q6_K), the block layouts, GGUF blocks loaded as
stored (against the gguf package's own dequantization), and the quantized model against float32 on the
default model."""

import functools

import gguf
import numpy as np
import pytest
import torch

from plait.kernels import cpu_isa
from plait.kernels.cpu_fused import add_rms_norm, gelu_mul, rms_norm, silu_mul
from plait.kernels.cpu_quant import (BY_GGML_TYPE, FORMATS, QuantMatmul, _library, deinterleave,
                                     dequantize, from_gguf, interleave, quant_linear, quant_linear_ref, quant_rows,
                                     quantize, tiled_rows)
from plait.kernels.cpu_quant import quant_linear as _quant_linear
from plait.kernels.q8_ref import quant_linear_q8_ref

C_KERNELS = cpu_isa.selected() != "ref"
Q = gguf.GGMLQuantizationType


def _cols(k: int, fmt) -> int:
    """k rounded up to whole blocks of the format (256 for the super-block formats)."""
    return -(-k // fmt.block_size) * fmt.block_size


def random_gguf_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF blocks of any layout: random bytes, with every float16 scale field set to a small positive value
    (the gguf package quantizes no K format, so the K-format tests start from blocks)."""
    rng = np.random.default_rng(seed)
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // size, nbytes), dtype=np.uint8)
    scales = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q5_0: [0], Q.Q4_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
    for off in scales[qtype]:
        d = rng.uniform(0.001, 0.02, size=(rows, cols // size)).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, cols // size, 2)
    return raw.reshape(rows, -1)


def test_kernel_builds_on_this_level():
    assert (_library() is not None) == C_KERNELS


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (1, 7, 32), (3, 9, 64), (5, 64, 1536), (17, 130, 96),
                                          (33, 4, 32), (2, 49152, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("exact", [True, False], ids=["int16", "int8"])
def test_quant_linear_matches_reference(fmt, rows, out, inp, bias, exact):
    inp = _cols(inp, fmt)
    torch.manual_seed(rows * out + inp)
    x, w = torch.randn(rows, inp), torch.randn(out, inp)
    b = torch.randn(out) if bias else None
    tiled = interleave(quantize(w, fmt), fmt)
    ref = quant_linear_ref if exact else quant_linear_q8_ref
    torch.testing.assert_close(quant_linear(x, tiled, fmt, b, exact), ref(x, tiled, fmt, b), atol=2e-4, rtol=1e-4)
    float_product = torch.nn.functional.linear(x, dequantize(quantize(w, fmt), fmt), b)
    error = lambda: ((quant_linear(x, tiled, fmt, b, exact) - float_product).norm() / float_product.norm()).item()  # noqa: E731
    if not exact:  # int8 activations: their rounding, ~1/254 a value, averaged over each block's products
        assert error() < 2e-2
        return
    # the exact scheme (int16 activations) is the float matmul over the same weight to ~1e-4, even with outlier
    # channels in x (int8 activations erred by 1-4% on such inputs, 100 times more)
    x[:, 1] *= 60
    float_product = torch.nn.functional.linear(x, dequantize(quantize(w, fmt), fmt), b)
    assert error() < 1e-3


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("exact", [True, False], ids=["int16", "int8"])
def test_quant_linear_is_batch_invariant(fmt, exact):
    """A row's output is bitwise the same alone, in any batch (the int8 path's few-row and many-row kernels) and
    on any thread count; with int8 activations a weight row's output is also the same bits in a whole tile as
    past the last one (the portable code)."""
    if not C_KERNELS:
        pytest.skip("PLAIT_CPU_ISA=ref: the torch reference makes no invariance promise")
    torch.manual_seed(2)
    k = _cols(96, fmt)
    x, w, b = torch.randn(40, k), torch.randn(67, k), torch.randn(67)
    tiled = interleave(quantize(w, fmt), fmt)
    alone = torch.cat([quant_linear(x[i : i + 1], tiled, fmt, b, exact) for i in range(x.shape[0])])
    threads = torch.get_num_threads()
    try:
        for rows in (2, 3, 5, 8, 13, 40):
            for n in {1, 2}:
                torch.set_num_threads(n)
                assert torch.equal(quant_linear(x[:rows], tiled, fmt, b, exact), alone[:rows]), (rows, n)
    finally:
        torch.set_num_threads(threads)
    if not exact:  # rows 60-63 in a whole tile, and on their own past the last one
        tail = interleave(quantize(w[60:64], fmt)[:3].contiguous(), fmt)
        assert torch.equal(quant_linear(x, tail, fmt, b[60:63], exact), alone[:, 60:63])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows,k", [(8, 512), (21, 1280)])
def test_many_rows_off_the_invariant_path_stay_close(fmt, rows, k):
    """Calls that need not be batch-invariant may take a faster path for many rows (bfloat16 dot products on a CPU
    that has them, 16 weight rows at a time, 1024 columns per pass): within bfloat16's rounding of the exact float
    product, prologues included; 70 weight rows are 4 whole panels, one of a single tile, and 2 rows past it."""
    torch.manual_seed(rows)
    raw = random_gguf_blocks(Q[fmt.name.upper()], 70, k)
    tiled = interleave(from_gguf(torch.from_numpy(raw), fmt.ggml_type), fmt)
    w, b, norm_w = dequantize(deinterleave(tiled, fmt), fmt), torch.randn(70), torch.rand(k) + 0.5
    mm = QuantMatmul(tiled, fmt, b)
    x, gate_up = torch.randn(rows, k), torch.randn(rows, 2 * k)

    def close(ours, exact):
        assert ((ours - exact).norm() / exact.norm()).item() < 1e-2

    close(mm(x, invariant=False), x @ w.T + b)
    close(mm.normed(x, norm_w, 1e-5, invariant=False), rms_norm(x, norm_w, 1e-5) @ w.T + b)
    close(mm.act_mul(gate_up, "gelu_tanh", invariant=False), gelu_mul(gate_up) @ w.T + b)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_many_row_layers_keep_one_copy_of_the_weight(fmt):
    """A block layer's calls of many rows (not batch-invariant) on the exact path run the kernel over its blocks on a
    CPU with AVX512-BF16 (no float copy is made), and oneDNN over a float32 copy of a Q8_0 / Q4_1 / Q5_0 weight
    elsewhere: the float product to ~1e-2 either way; invariant calls keep the exact kernel. With int8 activations no
    copy is made anywhere."""
    from plait.kernels.cpu_quant import BlockTensor, bf16_panels
    from plait.kernels.cpu_linear import MAX_ROWS
    from plait.runtime.layers.linear import Linear
    from plait.runtime.layers.quantization import BlockQuantizedMethod

    torch.manual_seed(5)
    rows, k = 4 * 700 + 2, 512  # more rows than one panel, and two past the last whole tile
    raw = random_gguf_blocks(Q[fmt.name.upper()], rows, k)
    blocks = from_gguf(torch.from_numpy(raw), fmt.ggml_type)
    w = dequantize(blocks, fmt)
    layer = Linear(k, {"": rows}, True, BlockQuantizedMethod(fmt))
    layer.weight_loader(BlockTensor(blocks, fmt, (rows, k)))
    layer.bias_loader(torch.randn(rows))
    layer.finish_loading()
    level = cpu_isa.selected()
    assert bf16_panels() == cpu_isa.native_bf16(level)
    copied = not bf16_panels() and not fmt.super_block
    assert (layer.onednn is not None) == (copied and torch.backends.mkldnn.is_available())
    x = torch.randn(MAX_ROWS + 40, k)
    exact = x @ w.T + layer.bias
    fast = layer(x)
    assert ((fast - exact).norm() / exact.norm()).item() < 1e-2
    invariant = layer(x, batch_invariant=True)
    assert torch.equal(invariant, quant_linear(x, layer.qweight.data, fmt, layer.bias))
    # int8 activations take every row count over the blocks themselves: no copy of the weight at all
    int8 = Linear(k, {"": rows}, True, BlockQuantizedMethod(fmt, exact=False))
    int8.weight_loader(BlockTensor(blocks, fmt, (rows, k)))
    int8.bias_loader(layer.bias.clone())
    int8.finish_loading()
    assert int8.onednn is None
    assert ((int8(x) - exact).norm() / exact.norm()).item() < 2e-2


def test_quantized_matmul_policy_picks_each_formats_activations():
    """--quantized-matmul, resolved, per weight format: int8-k gives the K formats (two-level input scales) int8 and
    the 32-blocks the exact path; a mixed layer keeps each shard's own."""
    from plait.runtime.layers.quantization import QuantConfig

    names = {"a": FORMATS[0], "b": FORMATS[3]}  # Q8_0, Q4_K
    for matmul, exact in {"exact": (True, True), "int8": (False, False), "int8-k": (True, False)}.items():
        quant = QuantConfig("auto", torch.float32, file_formats=names, matmul=matmul)
        assert (quant.method(["a"]).exact, quant.method(["b"]).exact) == exact, matmul
        assert [m.exact for m in quant.method(["a", "b"]).methods] == list(exact)
    with pytest.raises(ValueError, match="quantized_matmul"):
        QuantConfig("auto", torch.float32, file_formats=names, matmul="auto").method(["a"])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 3, 6, 17])
@pytest.mark.parametrize("exact", [True, False], ids=["int16", "int8"])
def test_fused_prologues_equal_the_two_steps(fmt, rows, exact):
    """The norm and the activation fused into the matmul's input give exactly the unfused result."""
    torch.manual_seed(rows)
    k = _cols(96, fmt)
    w, b, norm_w = torch.randn(68, k), torch.randn(68), torch.rand(k) + 0.5
    mm = QuantMatmul(interleave(quantize(w, fmt), fmt), fmt, b, exact)
    quant_linear = functools.partial(_quant_linear, exact=exact)
    x, gate_up = torch.randn(rows, k) * 3, torch.randn(rows, 2 * k) * 3
    assert torch.equal(mm(x), quant_linear(x, mm.tiled, fmt, b))
    assert torch.equal(mm.normed(x, norm_w, 1e-5), quant_linear(rms_norm(x, norm_w, 1e-5), mm.tiled, fmt, b))
    assert torch.equal(mm.act_mul(gate_up), quant_linear(silu_mul(gate_up), mm.tiled, fmt, b))
    assert torch.equal(mm.act_mul(gate_up, "gelu_tanh"), quant_linear(gelu_mul(gate_up), mm.tiled, fmt, b))
    residual, delta = torch.randn(rows, k), torch.randn(rows, k)
    mine, theirs = residual.clone(), residual.clone()
    summed, y = mm.add_normed(mine, delta, norm_w, 1e-5)
    theirs, h = add_rms_norm(theirs, delta, norm_w, 1e-5)
    assert torch.equal(summed, theirs) and torch.equal(y, quant_linear(h, mm.tiled, fmt, b))
    # a strided input takes the checked path, with the same result
    wide = torch.randn(rows, k + 104)
    assert torch.equal(mm(wide[:, :k]), quant_linear(wide[:, :k].contiguous(), mm.tiled, fmt, b))
    with pytest.raises(ValueError, match="features"):
        mm(torch.randn(rows, k - 32))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_row_lookup_is_the_dequantized_rows(fmt):
    torch.manual_seed(4)
    blocks = quantize(torch.randn(10, _cols(64, fmt)), fmt)
    ids = torch.tensor([9, 0, 4, 9, 7])
    assert torch.equal(quant_rows(interleave(blocks, fmt), fmt, ids), dequantize(blocks[ids], fmt))
    with pytest.raises(IndexError, match="row ids"):
        quant_rows(interleave(blocks, fmt), fmt, torch.tensor([10]))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_blocks_round_trip_and_bound_the_error(fmt):
    torch.manual_seed(3)
    k = _cols(128, fmt)
    w = torch.randn(37, k)
    blocks = quantize(w, fmt)
    assert blocks.shape == (37, fmt.row_bytes(k)) and blocks.dtype == torch.uint8
    dq = dequantize(blocks, fmt)
    if fmt.super_block:  # rounding to nearest with 6- and 8-bit sub-block scales
        bits = {"q4_k": 4, "q5_k": 5, "q6_k": 6}[fmt.name]
        assert ((dq - w).norm() / w.norm()).item() < 2.0 ** (1 - bits)
    else:
        # quantizing a dequantized weight gives the same blocks: a load is lossless for stored blocks
        assert torch.equal(quantize(dq, fmt), blocks)
        g = w.reshape(37, k // 32, 32)
        step = {"q8_0": g.abs().amax(-1) / 127, "q4_1": (g.amax(-1) - g.amin(-1)) / 15,
                "q5_0": g.abs().amax(-1) / 15}[fmt.name]
        err = (dq - w).abs().reshape(37, k // 32, 32).amax(-1)
        assert bool((err <= step * 0.51 + 1e-3).all())
    assert torch.equal(deinterleave(interleave(blocks, fmt), fmt), blocks)
    ids = torch.tensor([0, 5, 36, 3, 35])
    assert torch.equal(tiled_rows(interleave(blocks, fmt), fmt, ids), blocks[ids])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_gguf_blocks_load_exactly(qtype):
    """GGUF's own blocks dequantize to exactly what the gguf package dequantizes them to, through plait's
    repacking (Q4_0 becomes Q4_1, Q5_K's and Q6_K's high bits become planes) and the kernel's layout; the
    kernel multiplies by them to ~1e-5 of the float product."""
    raw = random_gguf_blocks(qtype, 8, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(8, 512))
    fmt = BY_GGML_TYPE[int(qtype)]
    blocks = from_gguf(torch.from_numpy(raw.copy()), int(qtype))
    assert torch.equal(dequantize(blocks, fmt), expected)
    tiled = interleave(blocks, fmt)
    assert torch.equal(quant_rows(tiled, fmt, torch.tensor([7, 0, 3])), expected[[7, 0, 3]])
    x = torch.randn(3, 512)
    exact = x @ expected.T
    assert ((quant_linear(x, tiled, fmt) - exact).norm() / exact.norm()).item() < 1e-4


@pytest.fixture(scope="module")
def runners():
    from plait.runtime.model_executor.model_runner import ModelRunner
    from plait.runtime.server_args import ServerArgs

    out = {}
    for name, kw in {"float32": {"dtype": "float32"}, "auto": {"quantization": "auto", "kv_cache_dtype": "float32"},
                     "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}.items():
        out[name] = ModelRunner(ServerArgs(max_total_tokens=2048, max_running_requests=4, num_threads=1, **kw).resolved(),
                                progress=False)
    return out


def _logits(runner, ids: list[int]) -> torch.Tensor:
    from plait.runtime.model_executor.model_runner import WorkItem

    row = runner.req_to_token.alloc()
    slots = runner.allocator.alloc_pages(len(ids))
    runner.req_to_token.table[row, : len(ids)] = slots
    try:
        return runner.forward([WorkItem(row, 0, ids, list(range(len(ids))))]).logits
    finally:
        runner.allocator.free(slots)
        runner.req_to_token.free(row)


def test_quantized_models_agree_with_float32(runners):
    """Next-token choices along a real prompt: the GGUF's own blocks (auto, the default; a float32 KV cache here)
    are the float32 model's weights, with int16 activations in decode-sized matmuls; int8 and int4
    requantize the weights. All must agree with float32 almost everywhere."""
    tok = runners["float32"].tokenizer
    ids = tok.encode("The capital of France is Paris. The capital of Italy is Rome. The largest planet in the "
                     "solar system is Jupiter, and the closest star to the Earth is the Sun.")
    ref = _logits(runners["float32"], ids)
    methods = {name: sorted({m.method.name for m in r.model.linears()}) for name, r in runners.items()}
    auto = ["q4_1", "q8_0"] if C_KERNELS else ["none"]
    assert methods == {"float32": ["none"], "auto": auto, "int8": ["q8_0"], "int4": ["q4_1", "q8_0"]}
    floors = {"auto": 0.95, "int8": 0.9, "int4": 0.75}
    for name, floor in floors.items():
        out = _logits(runners[name], ids)
        agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree >= floor, (name, agree)


def test_auto_keeps_float_weights_for_an_explicit_dtype():
    from plait.runtime.server_args import ServerArgs

    assert ServerArgs().resolved().quantization == ("auto" if C_KERNELS else "none")  # no blocks without the kernel
    assert ServerArgs(dtype="float32").resolved().quantization == "none"
    assert ServerArgs(dtype="float32", quantization="int8").resolved().quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        ServerArgs(quantization="fp8")


def test_quantized_batch_of_many_rows_matches_few(runners):
    """Prefill (many rows: oneDNN on the dequantized copy) and decode (the block kernel, int16
    activations) give the same next-token distribution, to the activations' rounding."""
    runner = runners["int8"]
    ids = list(range(100, 160))
    full = _logits(runner, ids)
    from plait.runtime.model_executor.model_runner import WorkItem

    row = runner.req_to_token.alloc()
    slots = runner.allocator.alloc_pages(len(ids))
    runner.req_to_token.table[row, : len(ids)] = slots
    try:
        runner.forward([WorkItem(row, 0, ids[:-1], [])])
        last = runner.forward([WorkItem(row, len(ids) - 1, ids[-1:], [0])]).logits
    finally:
        runner.allocator.free(slots)
        runner.req_to_token.free(row)
    p, q = full[-1].log_softmax(-1), last[0].log_softmax(-1)
    assert int(p.argmax()) == int(q.argmax())
    assert float((p.exp() * (p - q)).sum()) < 0.01


@pytest.mark.parametrize("levels", ["C", pytest.param("ref", marks=pytest.mark.slow)])
def test_every_isa_level_this_cpu_has_matches_the_reference(levels):
    """The kernel tests above, rerun with the kernel built for each level the CPU supports (PLAIT_CPU_ISA):
    AVX2's vpmaddwd path, AVX-512's wider tiles, VNNI's vpdpwssd; and `ref` (the torch reference, in
    `make test-slow`: the tests above compare the kernels with it already)."""
    import os
    import subprocess
    import sys

    others = [lvl for lvl in cpu_isa.supported_levels() if lvl != cpu_isa.selected()]
    chosen = [lvl for lvl in others if (lvl == "ref") == (levels == "ref")]
    if not chosen:
        pytest.skip(f"this CPU has no other {levels} level")
    for level in chosen:
        env = {**os.environ, "PLAIT_CPU_ISA": level}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", __file__, "-k",
                               "builds or matches_reference or invariant or round_trip or load_exactly or prologues or "
                               "lookup or stay_close or gemm"],
                              env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
        assert proc.returncode == 0 and " passed" in proc.stdout, f"PLAIT_CPU_ISA={level}:\n{proc.stdout[-3000:]}"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_load_layouts_in_c_equal_their_torch_references(fmt):
    """What loading does to a weight's bytes, in C where the kernels run (GGUF's Q6_K to plait's, the tile layout
    in place) and in torch: the same bytes, whole tiles and a tail."""
    from plait.kernels.cpu_quant import Q6_K, _interleave, _repack, interleave_

    if _library() is None:
        pytest.skip("the C kernels do not run here")
    raw = torch.randint(0, 256, (11, 3 * fmt.block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    if fmt is Q6_K:
        assert torch.equal(from_gguf(raw, fmt.ggml_type), _repack(raw, fmt.ggml_type))
    assert torch.equal(interleave_(raw.clone(), fmt), _interleave(raw, fmt))
