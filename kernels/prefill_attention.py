"""Prefill / chunked-prefill attention over the paged KV cache.

Grid `(num_prefills, num_heads, ceil(max_query_len / BLOCK_M))`. Request `r`'s
`q_len` query tokens sit at sequence positions `ctx .. seq_len - 1` where
`ctx = seq_len - q_len` tokens (a prefix-cache hit or earlier chunks) were already
cached; this step's keys were written to the cache before attention runs, so all
keys are read from the cache through the block table. Query at position `p` sees
keys `0 .. p` (causal across the cached prefix):

    keys   0 ........ ctx-1 | ctx ........ seq_len-1
    query ctx+i               sees keys 0 .. ctx+i

A program (request, head, query tile) stops its key loop at the last position its
tile can see, so cost follows the causal triangle. With a sliding window W, query
`p` sees keys `p - W < k <= p` only, and the loop also starts at the first key the
tile's first query sees: cost follows the band, and block-table entries before the
window are never loaded (the KV cache manager may have released those blocks). With
a soft cap c each score s becomes `c * tanh(s / c)` before the mask (Gemma 2). With
attention sinks (gpt-oss) head h's logit joins each row's denominator after the last
tile (`fold_sink`). Heads wider than 256 lanes (MLA's 576) take narrower tiles
(`tile_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import dot_precision, next_power_of_2, tile_config
from pagoda.kernels._paged_tile import LOG2_E, attend_paged_tile, fold_sink

_LOG2_E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, sinks_ptr, scale_log2, first_req, window, soft_cap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    req = first_req + tl.program_id(0)
    head = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = ctx_len + offs_m

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    kv_end = tl.minimum(seq_len, ctx_len + (m_tile + 1) * BLOCK_M)
    kv_lo = 0  # the first key the tile's first query sees
    if HAS_WINDOW:
        kv_lo = tl.maximum(ctx_len + m_tile * BLOCK_M - window + 1, 0)
    for start in range(kv_lo // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < kv_end) & (offs_n >= kv_lo)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible &= offs_n[None, :] > q_pos[:, None] - window
        m_i, l_i, acc = attend_paged_tile(
            q, m_i, l_i, acc, offs_n, n_mask, visible, table, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask, scale_log2, soft_cap,
            PAGE_SIZE, HAS_SOFT_CAP, DOT_PRECISION)

    if HAS_SINKS:  # the same logit for every row of this head
        sink = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * LOG2_E
        l_i, acc = fold_sink(m_i, l_i, acc, sink)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    query: torch.Tensor,  # [T, H, D], all tokens of the step
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
    out: torch.Tensor,  # [T, H, D], rows of requests first_req.. written
    first_req: int,
    num_reqs: int,
    max_query_len: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H] logits, one per query head
) -> None:
    """Launch for requests `first_req .. num_reqs - 1`. Arguments are checked by
    `pagoda.kernels.attention.paged_attention`."""
    _, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    block_d = max(16, next_power_of_2(head_dim))
    tiles = tile_config(block_d, query.device.type == "cuda")
    grid = (num_reqs - first_req, num_heads, triton.cdiv(max_query_len, tiles.block_m))
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        out, out if sinks is None else sinks, scale * _LOG2_E, first_req, sliding_window or 0, (logits_soft_cap or 1.0) * _LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=block_d, PAGE_SIZE=page_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(query.dtype), HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None, HAS_SINKS=sinks is not None,
        **tiles.launch_options(),
    )
