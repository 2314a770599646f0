"""Paged-attention decode: one query token per request, split-K over long contexts.

Grid `(num_seqs, num_kv_heads * group_chunks, num_splits)`. A program owns one KV
head and the `G = H / Hkv` query heads that share it (GQA), so each K/V tile is read
once per group, and the `G` query rows (padded to 16 for the tensor cores) form the M
side of the dot. Only where G rows x the padded head would make too large an
accumulator (MLA: 128 query heads of 576 over one KV head) are the group's heads cut
into chunks of BLOCK_G, one program each (`_MAX_GROUP_TILE`). The context's `ceil(seq_len / BLOCK_N)` tiles are cut into
`num_splits` contiguous ranges *inside the kernel* from the device-side `seq_len`,
so any `num_splits` is correct for any context length — which keeps the kernel
safe to replay from a CUDA graph captured at another length.

With one split the program normalises and writes the output directly; otherwise
each split writes its unnormalised accumulator with its running max `m` and sum `l`
(base-2 exponent domain), and `_reduce_kernel` merges them:

    out = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M),   M = max_s m_s

A request with `seq_len == 0` (batch padding) gets zeros.

With a sliding window W the query (at position `seq_len - 1`) sees keys
`seq_len - W .. seq_len - 1` only: the tile range starts at the window's first tile,
so a long context costs no more than W, and block-table entries before the window
are never loaded (the KV cache manager may have released those blocks). With a
soft cap c each score s becomes `c * tanh(s / c)` before the softmax (Gemma 2).

Attention sinks (gpt-oss: one logit per query head, in the denominator, no value) are
folded in once per row after its last tile (`fold_sink`); with several splits, only in
the reduce, where M also takes the sink: adding it per split would count it
`num_splits` times.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import dot_precision, next_power_of_2, num_sms, tile_config
from pagoda.kernels._paged_tile import LOG2_E, attend_paged_tile, fold_sink

# A split shorter than this many tokens is not worth its partial write + reduce.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32
_LOG2_E = 1.4426950408889634
# A program's query rows x head dims (BLOCK_G * BLOCK_D) stay at most this, so a wide
# head (MLA's 576, padded to 1024) with many query heads per KV head (MLA: all of them)
# is cut into several programs along the group instead of one huge accumulator.
_MAX_GROUP_TILE = 16384


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr,
    scale_log2, window, soft_cap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    G_CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // G_CHUNKS
    g_chunk = tl.program_id(1) % G_CHUNKS
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo = 0  # the first key the query sees
    if HAS_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    first_tile = kv_lo // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_g = g_chunk * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # Finite running-max sentinel: an empty split or an empty context (seq_len 0)
    # must never compute (-inf) - (-inf) = NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < seq_len) & (offs_n >= kv_lo)
        m_i, l_i, acc = attend_paged_tile(
            q, m_i, l_i, acc, offs_n, n_mask, n_mask[None, :], table, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask, scale_log2, soft_cap,
            PAGE_SIZE, HAS_SOFT_CAP, DOT_PRECISION)

    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * LOG2_E
            l_i, acc = fold_sink(m_i, l_i, acc, sink)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Partials: acc [num_seqs, H, NUM_SPLITS, BLOCK_D], ml [num_seqs, H, NUM_SPLITS, 2].
        row = (seq.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    row = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:  # the sink joins the denominator once, here, not once per split
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2_E
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max)
    total = tl.sum(l * w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_max)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough splits to give every SM about two programs, but no split shorter than
    `_MIN_TOKENS_PER_SPLIT` tokens of the longest context. Pure heuristic: any value
    is correct. Rounded down to a power of two because the split count is a compile
    time constant: a growing context must not trigger a recompile at every step."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = math.ceil(2 * num_sms(device) / programs)
    by_length = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    splits = int(max(1, min(wanted, by_length, _MAX_SPLITS)))
    return 1 << (splits.bit_length() - 1)


def decode_attention(
    query: torch.Tensor,  # [num_seqs, H, D], one token per request
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= num_seqs] int32
    scale: float,
    out: torch.Tensor,  # [num_seqs, H, D], written
    max_seq_len: int,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H] logits, one per query head
) -> None:
    """Launch the decode kernel (and the split reduce). Arguments are checked by
    `pagoda.kernels.attention.paged_attention`."""
    num_seqs, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    block_d = max(16, next_power_of_2(head_dim))
    block_g = min(max(16, next_power_of_2(group)), max(16, _MAX_GROUP_TILE // block_d))
    g_chunks = triton.cdiv(group, block_g)
    if num_splits is None:
        longest = min(max_seq_len, sliding_window or max_seq_len)  # keys actually read
        num_splits = choose_num_splits(num_seqs, num_kv_heads * g_chunks, longest, query.device)
    part_acc = part_ml = out  # unused placeholders when there is one split
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32,
                              device=query.device)
    tiles = tile_config(block_d, query.device.type == "cuda")
    sinks_arg = out if sinks is None else sinks  # placeholder pointer when there are none
    _decode_kernel[(num_seqs, num_kv_heads * g_chunks, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, out, part_acc, part_ml, sinks_arg,
        scale * _LOG2_E,  # the kernel works in base 2
        sliding_window or 0, (logits_soft_cap or 1.0) * _LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=block_g, G_CHUNKS=g_chunks,
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=page_size,
        BLOCK_N=tiles.block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(query.dtype), HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None, HAS_SINKS=sinks is not None,
        **tiles.launch_options(),
    )
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_ml, sinks_arg, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
            HAS_SINKS=sinks is not None,
        )
