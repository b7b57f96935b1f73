"""Kernels against their torch references."""

import os

import pytest
import torch

from plait.kernels import cpu_fused, cpu_isa
from plait.kernels.cpu_attention import _library, paged_attention, paged_attention_ref
from plait.kernels.cpu_linear import _library as linear_library
from plait.kernels.cpu_linear import block_bf16, linear_ref, skinny_linear


C_KERNELS = cpu_isa.selected() != "ref"  # PLAIT_CPU_ISA=ref: only the torch references run


def _expect_kernel(present) -> None:
    if C_KERNELS:
        assert present, "the C kernel should build here (a C compiler is on the machine)"
    else:
        assert not present, "PLAIT_CPU_ISA=ref must run no C kernel"


# rows of more than 256 keys are attended in parts (one task each) merged by their log-sum-exps
@pytest.mark.parametrize("batch,heads,groups,dim,length", [(1, 3, 3, 64, 7), (5, 2, 4, 32, 40), (64, 3, 3, 64, 300),
                                                           (1, 3, 3, 64, 1100), (3, 2, 1, 16, 700)])
def test_paged_attention_kernel_matches_reference(batch, heads, groups, dim, length):
    _expect_kernel(_library())
    torch.manual_seed(0)
    slots_total = 4096
    k = torch.randn(heads, slots_total, dim)
    v = torch.randn(heads, slots_total, dim)
    slots = torch.randint(1, slots_total, (batch, length))
    lens = torch.randint(1, length + 1, (batch,))
    lens[0] = 1 if batch > 1 else length
    q = torch.randn(batch, heads, groups, dim)
    out, lse = paged_attention(q, k, v, slots, lens, dim**-0.5)
    ref_out, ref_lse = paged_attention_ref(q, k, v, slots, lens, dim**-0.5)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (lse - ref_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize("heads,groups,dim", [(3, 3, 64), (2, 1, 16), (1, 5, 8), (2, 9, 64), (2, 2, 12)])
def test_paged_attention_extend_rows_match_reference(heads, groups, dim):
    """Extend tokens share their request's slot row and each sees the keys up to its position."""
    torch.manual_seed(heads * groups + dim)
    k, v = torch.randn(heads, 512, dim), torch.randn(heads, 512, dim)
    slots = torch.randint(1, 512, (3, 40))
    q_lens = torch.tensor([40, 1, 17])
    rows = torch.repeat_interleave(torch.arange(3), q_lens)
    lens = torch.cat([torch.arange(1, 41), torch.tensor([33]), torch.arange(5, 22)])
    q = torch.randn(rows.numel(), heads, groups, dim)
    out, lse = paged_attention(q, k, v, slots, lens, dim**-0.5, rows)
    ref_out, ref_lse = paged_attention_ref(q, k, v, slots, lens, dim**-0.5, rows)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # token 0 sees one key: its output is that key's value
    torch.testing.assert_close(out[0], v[:, slots[0, 0]].unsqueeze(1).expand(heads, groups, dim))


@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_fused_ops_match_torch(rows):
    _expect_kernel(cpu_fused._library())
    torch.manual_seed(rows)
    x, y, w = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    gate_up = 4 * torch.randn(rows, 3072)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-5), cpu_fused.rms_norm_ref(x, w, 1e-5))
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up), cpu_fused.silu_mul_ref(gate_up))
    ref_sum, ref_norm = cpu_fused.add_rms_norm_ref(x, y, w, 1e-5)
    total, normed = cpu_fused.add_rms_norm(x.clone(), y, w, 1e-5)
    torch.testing.assert_close(total, ref_sum)
    torch.testing.assert_close(normed, ref_norm)


def test_kernel_falls_back_for_other_dtypes():
    k = torch.randn(2, 64, 16, dtype=torch.bfloat16)
    q = torch.randn(2, 2, 2, 16, dtype=torch.bfloat16)
    slots = torch.randint(1, 64, (2, 5))
    lens = torch.tensor([5, 3])
    out, _ = paged_attention(q, k, k, slots, lens, 0.25)
    ref, _ = paged_attention_ref(q, k, k, slots, lens, 0.25)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (3, 4, 8), (5, 9, 20), (7, 1, 1), (2, 49152, 576), (32, 33, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear(rows, out, inp, bias):
    _expect_kernel(linear_library())
    torch.manual_seed(rows * out + inp)
    x, w = torch.randn(rows, inp), torch.randn(out, inp)
    b = torch.randn(out) if bias else None
    y = skinny_linear(x, w, b)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (5, 9, 20), (32, 33, 31), (2, 49152, 64)])
def test_skinny_linear_16bit_weights_match_reference(dtype, rows, out, inp):
    """16-bit weights widen exactly, so the kernel agrees with float32 arithmetic on the widened weight."""
    _expect_kernel(linear_library())
    torch.manual_seed(rows + out)
    x, w, b = torch.randn(rows, inp), torch.randn(out, inp).to(dtype), torch.randn(out)
    torch.testing.assert_close(skinny_linear(x, w, b), linear_ref(x, w, b), atol=1e-4, rtol=1e-4)
    blocked = block_bf16(w)
    if dtype == torch.bfloat16 and C_KERNELS:
        assert blocked is not None and blocked.shape == w.shape
        torch.testing.assert_close(skinny_linear(x, w, b, blocked=blocked), linear_ref(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "bfloat16-blocked"])
def test_skinny_linear_is_batch_invariant(dtype):
    """With batch_invariant, a row's output is bitwise the same alone, in any batch, on any thread count."""
    if not C_KERNELS:
        pytest.skip("PLAIT_CPU_ISA=ref: the torch reference makes no invariance promise")
    torch.manual_seed(1)
    blocked = dtype == "bfloat16-blocked"
    x, w, b = torch.randn(130, 200), torch.randn(67, 200).to(torch.bfloat16 if blocked else dtype), torch.randn(67)
    kw = {"batch_invariant": True, "blocked": block_bf16(w) if blocked else None}
    alone = torch.cat([skinny_linear(x[i : i + 1], w, b, **kw) for i in range(x.shape[0])])
    threads = torch.get_num_threads()
    try:
        for rows in (2, 3, 7, 48, 49, 130):
            for n in {1, max(2, threads)}:
                torch.set_num_threads(n)
                assert torch.equal(skinny_linear(x[:rows], w, b, **kw), alone[:rows]), (rows, n)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(alone, linear_ref(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_16bit_pool_matches_reference(dtype):
    _expect_kernel(_library())
    torch.manual_seed(3)
    heads, groups, dim = 3, 3, 64
    k, v = torch.randn(heads, 1024, dim).to(dtype), torch.randn(heads, 1024, dim).to(dtype)
    slots = torch.randint(1, 1024, (6, 90))
    lens = torch.tensor([1, 5, 90, 33, 64, 8])
    q = torch.randn(6, heads, groups, dim)
    out, lse = paged_attention(q, k, v, slots, lens, dim**-0.5)
    ref_out, ref_lse = paged_attention_ref(q, k, v, slots, lens, dim**-0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_paged_attention_is_batch_and_position_invariant():
    """A query's output depends only on its keys: bitwise the same alone or in a batch, on one thread or two, and
    an extend token equals the decode step that sees the same keys (rows past 256 keys attended in parts too)."""
    if not C_KERNELS:
        pytest.skip("PLAIT_CPU_ISA=ref: the torch reference makes no invariance promise")
    torch.manual_seed(4)
    heads, groups, dim = 3, 3, 64
    k, v = torch.randn(heads, 1024, dim), torch.randn(heads, 1024, dim)
    slots = torch.randint(1, 1024, (5, 600))
    lens = torch.tensor([600, 3, 41, 300, 1])
    q = torch.randn(5, heads, groups, dim)
    batched, _ = paged_attention(q, k, v, slots, lens, dim**-0.5)
    threads = torch.get_num_threads()
    for i in range(5):
        for n in {1, 2}:
            torch.set_num_threads(n)
            try:
                alone, _ = paged_attention(q[i : i + 1], k, v, slots[i : i + 1], lens[i : i + 1], dim**-0.5)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(alone, batched[i : i + 1]), (i, n)
    # request 0 as 600 extend tokens: token t sees t + 1 keys, like a decode step at that length
    qe = torch.randn(600, heads, groups, dim)
    ext, _ = paged_attention(qe, k, v, slots[:1], torch.arange(1, 601), dim**-0.5, torch.zeros(600, dtype=torch.int64))
    for t in (0, 1, 31, 255, 256, 257, 511, 599):
        dec, _ = paged_attention(qe[t : t + 1], k, v, slots[:1], torch.tensor([t + 1]), dim**-0.5)
        assert torch.equal(dec, ext[t : t + 1]), t


def test_skinny_linear_from_several_threads():
    """The kernel's worker pool serialises concurrent callers (several engines in one process)."""
    from concurrent.futures import ThreadPoolExecutor

    w = torch.randn(1024, 256)
    xs = [torch.randn(2, 256) for _ in range(64)]
    with ThreadPoolExecutor(4) as ex:
        ys = list(ex.map(lambda x: skinny_linear(x, w), xs))
    for x, y in zip(xs, ys):
        torch.testing.assert_close(y, x @ w.T, atol=1e-4, rtol=1e-4)


_TRITON_BITMASK = r'''
import torch
from plait.kernels.triton_bitmask import apply_token_bitmask_triton
from plait.runtime.constrained.bitmask import apply_token_bitmask_ref
g = torch.Generator().manual_seed(0)
for batch, vocab in [(1, 49152), (5, 1000), (3, 33)]:
    logits = torch.randn(batch, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    ref, out = logits.clone(), logits.clone()
    apply_token_bitmask_ref(ref, bitmask)
    apply_token_bitmask_triton(out, bitmask)
    assert torch.equal(ref, out), (batch, vocab)
    allowed = ~torch.isinf(ref)
    assert 0 < int(allowed.sum()) < batch * vocab
print("ok")
'''


def test_triton_bitmask_kernel_matches_torch_reference():
    """The GPU kernel, run by Triton's interpreter on CPU, against the torch reference."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # must be set before triton is imported
    done = subprocess.run([sys.executable, "-c", _TRITON_BITMASK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_bitmask_unpack_matches_matcher(tokenizer):
    """Bit j of word w is token 32w+j, for both backends' mask writers."""
    import json

    from plait.runtime.constrained import create_backend
    from plait.runtime.constrained.bitmask import allocate_bitmask, unpack_bitmask

    for name in ("xgrammar", "outlines"):
        backend = create_backend(name, tokenizer, 49152, [tokenizer.eos_token_id])
        m = backend.compile("json_schema", json.dumps({"enum": ["yes", "no"]})).matcher()
        bm = allocate_bitmask(1, 49152)
        m.fill_bitmask(bm, 0)
        allowed = unpack_bitmask(bm, 49152)[0].nonzero().view(-1).tolist()
        assert allowed and all(tokenizer.decode([t]) in '"yes"' or tokenizer.decode([t]) in '"no"' for t in allowed)
        assert all(m.copy().accept_token(t) for t in allowed)


@pytest.mark.skipif(not C_KERNELS, reason="PLAIT_CPU_ISA=ref: no C kernel to compare")
def test_c_bitmask_kernel_matches_torch_reference():
    from plait.kernels.cpu_bitmask import apply_token_bitmask_cpu
    from plait.runtime.constrained.bitmask import apply_token_bitmask_ref

    g = torch.Generator().manual_seed(1)
    for batch, vocab in [(1, 49152), (7, 1000), (3, 33)]:
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (batch, words), dtype=torch.int32, generator=g)
        bitmask[:, ::3] = -1  # whole words allowed
        bitmask[:, 1::5] = 0  # whole words refused
        logits = torch.randn(batch, vocab + 5, generator=g)[:, :vocab]  # strided rows
        ref, out = logits.clone(), logits.clone()
        apply_token_bitmask_ref(ref, bitmask)
        assert apply_token_bitmask_cpu(out, bitmask)
        assert torch.equal(ref, out), (batch, vocab)


# ---- instruction-set levels -------------------------------------------------------------------
def test_every_isa_level_this_cpu_has_matches_the_references():
    """The kernel tests above, rerun with the kernels built for each level the CPU supports
    (PLAIT_CPU_ISA), `ref` (torch references only) included."""
    import subprocess
    import sys

    from plait.kernels import cpu_isa

    levels = [lvl for lvl in cpu_isa.supported_levels() if lvl != cpu_isa.selected()]
    for level in levels:
        env = {**os.environ, "PLAIT_CPU_ISA": level}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", __file__, "-k",
                               "matches_reference or match_torch or matches_f_linear or c_bitmask or falls_back or invariant or agree"],
                              env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
        assert proc.returncode == 0 and " passed" in proc.stdout, f"PLAIT_CPU_ISA={level}:\n{proc.stdout[-3000:]}"


def test_isa_level_is_checked_and_keys_the_cache(monkeypatch):
    from plait.kernels import cpu_build, cpu_isa

    with pytest.raises(ValueError, match="must be one of"):
        cpu_isa.check_level("avx9000")
    lacking = [lvl for lvl in cpu_isa.LEVELS if lvl not in cpu_isa.supported_levels()]
    for lvl in lacking:
        with pytest.raises(ValueError, match="this CPU lacks"):
            cpu_isa.check_level(lvl)
    assert cpu_isa.detect(frozenset({"avx2", "fma", "f16c"})) == "avx2"
    assert cpu_isa.detect(frozenset()) == "ref"
    assert cpu_isa.detect(frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                                     "avx512_bf16", "avx512_vnni"})) == "avx512_bf16"
    assert cpu_isa.detect(frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                                     "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"})) == "amx"
    source = cpu_build.Path(cpu_build.__file__).with_name("fused_ops.c")
    built = {lvl: cpu_build._build(source, lvl) for lvl in cpu_isa.supported_levels() if lvl != "ref"}
    assert len(set(built.values())) == len(built)  # one cached library per level
    assert all(lvl in path.name for lvl, path in built.items())
    assert "-march=native" not in cpu_build._FLAGS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_layer_paths_agree(dtype):
    """The layer's three routes for a weight stored in `dtype`: the kernel (few rows), oneDNN on the
    packed copy the CPU level picks (many rows), and oneDNN on a bf16 copy (the route of CPUs with
    native bf16, runnable, if slower, on any that oneDNN's bf16 supports: AVX-512 BW or AVX-NE-CONVERT)."""
    from plait.runtime.layers.linear import linear, pack, packed_dtype

    torch.manual_seed(5)
    w, b = torch.randn(300, 96).to(dtype), torch.randn(300)
    few, many = torch.randn(4, 96), torch.randn(70, 96)
    torch.testing.assert_close(linear(few, w, b), linear_ref(few, w, b), atol=1e-4, rtol=1e-4)
    packed = pack(w)
    torch.testing.assert_close(linear(few, w, b, packed), linear_ref(few, w, b), atol=1e-4, rtol=1e-4)
    if packed.onednn is None:
        pytest.skip("no oneDNN in this torch build")
    assert packed.onednn.dtype == packed_dtype(dtype)
    assert (packed.kernel is not None) == (dtype == torch.bfloat16 and C_KERNELS)
    if packed.onednn.dtype == torch.float32:
        torch.testing.assert_close(linear(many, w, b, packed), linear_ref(many, w, b), atol=1e-4, rtol=1e-4)
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # activations rounded to bf16 on that route: agreement to bf16 precision
        torch.testing.assert_close(linear(many, w, b, pack(w, torch.bfloat16)), linear_ref(many, w, b),
                                   atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_store_matches_reference(dtype):
    """RoPE on q and k with the K/V store, in one pass: q and the stored K/V equal the torch reference
    (rounded the same way into a 16-bit pool)."""
    _expect_kernel(cpu_fused._library())
    torch.manual_seed(6)
    heads, kv_heads, d, tokens = 9, 3, 64, 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d)
    angles = torch.randn(tokens, d // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.randperm(200)[:tokens]
    pools = [torch.zeros(kv_heads, 200, d, dtype=dtype) for _ in range(4)]
    q = cpu_fused.rope_store(qkv, cos, sin, heads, kv_heads, pools[0], pools[1], slots)
    q_ref = cpu_fused.rope_store_ref(qkv, cos, sin, heads, kv_heads, pools[2], pools[3], slots)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[0].float(), pools[2].float(), atol=1e-5, rtol=1e-2 if dtype != torch.float32 else 1e-5)
    assert torch.equal(pools[1], pools[3])  # v is stored unchanged (same rounding)



def test_an_intrinsic_beyond_a_levels_flags_fails_its_build(tmp_path):
    from plait.kernels import cpu_build, cpu_isa

    if not cpu_isa._is_x86() or cpu_build._compiler() is None:
        pytest.skip("needs an x86 C compiler")
    wide = tmp_path / "wide.c"
    wide.write_text("#include <immintrin.h>\n__m512 twice(__m512 a) { return _mm512_add_ps(a, a); }\n")
    with pytest.raises(RuntimeError, match="does not compile for avx2"):
        cpu_build.check_compiles(wide, "avx2")


@pytest.mark.slow
def test_every_kernel_compiles_at_every_level():
    """Levels this CPU lacks cannot be run here, but their builds must still compile (never loaded)."""
    from plait.kernels import cpu_build, cpu_isa

    if not cpu_isa._is_x86() or cpu_build._compiler() is None:
        pytest.skip("needs an x86 C compiler")
    from concurrent.futures import ThreadPoolExecutor

    # the selected level is built at -O3 and run by the tests that load it
    sources = sorted(cpu_build.Path(cpu_build.__file__).parent.glob("*.c"))
    others = [lvl for lvl in cpu_isa.LEVELS[1:] if lvl != cpu_isa.selected()]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: cpu_build.check_compiles(*job), [(s, lvl) for s in sources for lvl in others]))


_TRITON_LORA = r'''
import torch
from plait.kernels.triton_lora import lora_ref, lora_triton, stack_pairs
g = torch.Generator().manual_seed(0)
for k, n, ranks, segs in [(64, 96, [4, 8, 2], [(0, 3, 0), (3, 4, 2), (4, 21, 1), (25, 30, 0)]),
                          (40, 33, [16], [(2, 5, 0)]), (96, 200, [24, 5], [(0, 17, 1), (20, 37, 0)])]:
    pairs = [(torch.randn(r, k, generator=g), torch.randn(r, n, generator=g)) for r in ranks]
    a, bt = stack_pairs(pairs)
    x, y0 = torch.randn(40, k, generator=g), torch.randn(40, n, generator=g)
    ref, out = y0.clone(), y0.clone()
    lora_ref(x, ref, a, bt, segs)
    lora_triton(x, out, a, bt, segs)
    assert torch.allclose(ref, out, atol=1e-3, rtol=1e-4), (ref - out).abs().max()
    assert not torch.equal(ref, y0)
    untouched = [i for i in range(40) if not any(s <= i < e for s, e, _ in segs)]
    assert torch.equal(out[untouched], y0[untouched])
print("ok")
'''


def test_triton_lora_kernels_match_torch_reference():
    """The segmented LoRA product (shrink, expand) under Triton's interpreter against its torch reference: mixed
    ranks padded to the stack's, segments of one row to several blocks, rows outside every segment untouched."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # must be set before triton is imported
    done = subprocess.run([sys.executable, "-c", _TRITON_LORA], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
