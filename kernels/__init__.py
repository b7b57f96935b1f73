"""Triton kernels, each beside a plain-torch reference with the same signature.

The CPU runtime uses the torch references (see plait.runtime.layers.attention); Triton
versions land here with their dispatchers as the GPU path grows.
"""
