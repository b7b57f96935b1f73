"""Sampler semantics on synthetic logits (the engine tests cover it on the real model)."""

import torch

from plait.runtime.sampling import SampleRow, SamplingParams, sample


def _row(seed=0, prompt=(), output=(), banned=(), lp=False, top=0, **params):
    return SampleRow(SamplingParams.from_dict(params), torch.Generator().manual_seed(seed), list(output),
                     list(prompt), list(banned), lp, top)


def _draws(logits, n=300, **params):
    rows = [_row(seed=i, **params) for i in range(n)]
    return sample(logits.expand(n, -1).contiguous(), rows).next_ids


def test_greedy_and_banned_ids():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample(logits, [_row(temperature=0)]).next_ids == [1]
    assert sample(logits, [_row(temperature=0, banned=[1])]).next_ids == [3]


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert set(_draws(logits, top_k=2)) == {0, 1}
    assert set(_draws(logits, top_p=0.65)) == {0, 1}  # 0.4 + 0.3 crosses 0.65
    assert set(_draws(logits, min_p=0.6)) == {0, 1}  # 0.6 * 0.4 = 0.24 keeps 0.4 and 0.3
    assert set(_draws(logits)) == {0, 1, 2, 3}


def test_temperature_sharpens():
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    cold = _draws(logits, n=400, temperature=0.2).count(0)
    hot = _draws(logits, n=400, temperature=1.0).count(0)
    assert cold > hot


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    assert sample(logits, [_row(temperature=0, output=[0], frequency_penalty=0.5)]).next_ids == [1]
    assert sample(logits, [_row(temperature=0, output=[0], presence_penalty=0.5)]).next_ids == [1]
    assert sample(logits, [_row(temperature=0, prompt=[0], repetition_penalty=1.2)]).next_ids == [1]
    assert sample(logits, [_row(temperature=0, prompt=[0], repetition_penalty=1.0)]).next_ids == [0]


def test_seeds_are_per_request():
    logits = torch.randn(1, 50)
    a = sample(logits, [_row(seed=7, temperature=1.0)]).next_ids
    b = sample(torch.cat([torch.randn(1, 50), logits]), [_row(seed=3), _row(seed=7, temperature=1.0)]).next_ids
    assert a[0] == b[1]


def test_logprobs_of_chosen_and_top():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    res = sample(logits, [_row(temperature=0, lp=True, top=2)])
    ref = torch.log_softmax(logits, -1)[0]
    assert abs(res.logprobs[0] - ref[2].item()) < 1e-6
    assert res.top_logprobs[0][1] == [2, 1]
