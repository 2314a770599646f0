"""One key/value tile of paged attention, shared by the decode and prefill kernels
(imports triton: CUDA/interpreter only).

Both kernels walk a request's keys tile by tile (BLOCK_N positions) through its block
table and fold each tile into an online softmax in the base-2 domain (scores scaled by
scale * log2(e)): a running max m_i [R], sum l_i [R] and output acc [R, D] per query
row. Only which keys a row may see differs (causal and window masks in prefill), so
the caller passes that as `visible`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagoda.kernels._math import tanh

# log2(e), for kernels: sinks are natural-log logits, the softmax runs in base 2.
LOG2_E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def attend_paged_tile(q, m_i, l_i, acc, offs_n, n_mask, visible, table,
                      k_head_ptr, v_head_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
                      offs_d, d_mask, scale_log2, soft_cap, PAGE_SIZE: tl.constexpr,
                      HAS_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the keys at positions `offs_n` (`n_mask`: positions that exist) into the
    state (m_i, l_i, acc) of the query rows q [R, D] and return the new state.

    `table` points at the request's block-table row; `k_head_ptr`/`v_head_ptr` at the
    caches already offset to this KV head. Scores are soft-capped when HAS_SOFT_CAP and
    -inf where not `visible` [R, BLOCK_N]. m_i must start finite (-1e30, not -inf): a
    tile with no visible key then leaves the state as it was instead of computing NaN.
    """
    blocks = tl.load(table + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_head_ptr + blocks[:, None] * stride_kb + in_page[:, None] * stride_ks
                + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if HAS_SOFT_CAP:  # cap * tanh(score / cap), still in the base-2 domain
        s = soft_cap * tanh(s / soft_cap)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head_ptr + blocks[:, None] * stride_vb + in_page[:, None] * stride_vs
                + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def fold_sink(m_i, l_i, acc, sink):
    """Add an attention sink (one logit per row, base-2 domain like m_i, shape [R]) to a
    row's softmax: it joins the denominator l_i and contributes no value. Rescaled to
    the new max, so a row that saw no key (m_i still -1e30) gets l = 1 and keeps acc 0:
    the sink takes all the weight and the output is zero, as the torch path's softmax
    with a sink column gives. Call once per row, after its last tile (split-K: in the
    reduce, never per split)."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]
