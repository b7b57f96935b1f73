"""Kernels against their torch references."""

import pytest
import torch

from plait.kernels.cpu_attention import _library, paged_decode_attention, paged_decode_attention_ref
from plait.kernels.cpu_linear import _library as linear_library
from plait.kernels.cpu_linear import skinny_linear


@pytest.mark.parametrize("batch,heads,groups,dim,length", [(1, 3, 3, 64, 7), (5, 2, 4, 32, 40), (64, 3, 3, 64, 300)])
def test_paged_decode_kernel_matches_reference(batch, heads, groups, dim, length):
    assert _library() is not None, "the C kernel should build here (a C compiler is on the machine)"
    torch.manual_seed(0)
    slots_total = 4096
    k = torch.randn(slots_total, heads, dim)
    v = torch.randn(slots_total, heads, dim)
    slots = torch.randint(1, slots_total, (batch, length))
    lens = torch.randint(1, length + 1, (batch,))
    lens[0] = 1
    q = torch.randn(batch, heads, groups, dim)
    out, lse = paged_decode_attention(q, k, v, slots, lens, dim**-0.5)
    ref_out, ref_lse = paged_decode_attention_ref(q, k, v, slots, lens, dim**-0.5)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (lse - ref_lse).abs().max().item() < 1e-5


def test_kernel_falls_back_for_other_dtypes():
    k = torch.randn(64, 2, 16, dtype=torch.bfloat16)
    q = torch.randn(2, 2, 2, 16, dtype=torch.bfloat16)
    slots = torch.randint(1, 64, (2, 5))
    lens = torch.tensor([5, 3])
    out, _ = paged_decode_attention(q, k, k, slots, lens, 0.25)
    ref, _ = paged_decode_attention_ref(q, k, k, slots, lens, 0.25)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (3, 4, 8), (5, 9, 20), (7, 1, 1), (2, 49152, 576), (32, 33, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear(rows, out, inp, bias):
    assert linear_library() is not None, "the C compiler is part of the test machine"
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
