"""Triton device functions shared by the kernels (imports triton: CUDA/interpreter only)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh in fp32 as 1 - 2 / (exp(2x) + 1), independent of a libdevice build (the
    CPU interpreter has none). |x| is clamped at 15, where tanh is 1 in fp32, so exp
    never overflows."""
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

