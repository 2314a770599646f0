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


@triton.jit
def attend_kv_tile(q, m_i, l_i, acc, k_ptrs, v_ptrs, kv_mask, visible, scale_log2, soft_cap,
                   HAS_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key/value tile of the online softmax, in the base-2 domain: the scores of
    q [R, D] against the tile's keys (soft-capped when HAS_SOFT_CAP, -inf where not
    `visible`), folded into the running max m_i [R], sum l_i [R] and output acc [R, D].
    Returns the new (m_i, l_i, acc). m_i must start finite (-1e30, not -inf): a tile with
    no visible key then leaves the state as it was instead of computing NaN."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if HAS_SOFT_CAP:  # cap * tanh(score / cap), still in the base-2 domain
        s = soft_cap * tanh(s / soft_cap)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
