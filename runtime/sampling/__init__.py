"""Sampling parameters and the batched sampler."""

from plait.runtime.sampling.params import SamplingParams
from plait.runtime.sampling.sampler import SampleResult, SampleRow, sample

__all__ = ["SamplingParams", "SampleRow", "SampleResult", "sample"]
