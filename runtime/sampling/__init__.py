"""Sampling parameters and the batched sampler (names import on first use: the parameters need no torch)."""

from plait.runtime.lazy import lazy_exports

_NAMES = {"SamplingParams": "params", "SampleRow": "sampler", "SampleResult": "sampler", "sample": "sampler"}
__getattr__ = lazy_exports(__name__, _NAMES)
__all__ = list(_NAMES)
