"""Kernels against their torch references."""

import os

import pytest
import torch

from plait.kernels import cpu_fused, cpu_isa
from plait.kernels.cpu_attention import _library, paged_attention, paged_attention_ref
from plait.kernels.cpu_linear import _library as linear_library
from plait.kernels.cpu_linear import skinny_linear


C_KERNELS = cpu_isa.selected() != "ref"  # PLAIT_CPU_ISA=ref: only the torch references run


def _expect_kernel(present) -> None:
    if C_KERNELS:
        assert present, "the C kernel should build here (a C compiler is on the machine)"
    else:
        assert not present, "PLAIT_CPU_ISA=ref must run no C kernel"


@pytest.mark.parametrize("batch,heads,groups,dim,length", [(1, 3, 3, 64, 7), (5, 2, 4, 32, 40), (64, 3, 3, 64, 300)])
def test_paged_attention_kernel_matches_reference(batch, heads, groups, dim, length):
    _expect_kernel(_library())
    torch.manual_seed(0)
    slots_total = 4096
    k = torch.randn(heads, slots_total, dim)
    v = torch.randn(heads, slots_total, dim)
    slots = torch.randint(1, slots_total, (batch, length))
    lens = torch.randint(1, length + 1, (batch,))
    lens[0] = 1
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
                               "matches_reference or match_torch or matches_f_linear or c_bitmask or falls_back"],
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
    source = cpu_build.Path(cpu_build.__file__).with_name("fused_ops.c")
    built = {lvl: cpu_build._build(source, lvl) for lvl in cpu_isa.supported_levels() if lvl != "ref"}
    assert len(set(built.values())) == len(built)  # one cached library per level
    assert all(lvl in path.name for lvl, path in built.items())
    assert "-march=native" not in cpu_build._FLAGS
