"""Paged attention for one step: decode rows by the split-K decode kernel, the rest
(full and chunked prefills, prefix-cache hits) by the prefill kernel.

Same arguments and result as the torch path `pagoda.model.attention.paged_attention`.
Only host-side metadata (`num_decodes`, `max_query_len`, `max_seq_len`, the `_cpu`
lists) steers the launch, so the call never syncs with the device and a pure-decode
batch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from pagoda.kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor
from pagoda.kernels.paged_decode import decode_attention
from pagoda.kernels.prefill_attention import prefill_attention
from pagoda.kernels.attention_metadata import AttentionMetadata

_INDEX_DTYPES = (torch.int32,)


def _check_args(query, key_cache, value_cache, md: AttentionMetadata) -> None:
    num_tokens, num_heads, head_dim = query.shape
    check_tensor("query", query, (num_tokens, num_heads, head_dim), FLOAT_DTYPES)
    check_tensor("key_cache", key_cache, (None, None, None, head_dim), (query.dtype,))
    check_tensor("value_cache", value_cache, tuple(key_cache.shape), (query.dtype,))
    num_kv_heads = key_cache.shape[2]
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    num_reqs = md.num_reqs
    check_tensor("seq_lens", md.seq_lens, (num_reqs,), _INDEX_DTYPES)
    check_tensor("query_start_loc", md.query_start_loc, (num_reqs + 1,), _INDEX_DTYPES)
    check_tensor("block_tables", md.block_tables, (num_reqs, None), _INDEX_DTYPES)
    check_same_device(query=query, key_cache=key_cache, value_cache=value_cache,
                      seq_lens=md.seq_lens, query_start_loc=md.query_start_loc,
                      block_tables=md.block_tables)
    qsl = md.query_start_loc_cpu
    assert len(qsl) == num_reqs + 1 and qsl[-1] <= num_tokens, (
        f"query_start_loc_cpu {qsl} does not fit {num_tokens} query tokens")
    assert qsl[md.num_decodes] == md.num_decodes, (
        f"the first {md.num_decodes} requests must be decodes of one token each: {qsl}")


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,  # decode split-K override (tests, benchmarks)
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's query tokens over its cached context -> [T, H, D],
    within `sliding_window` keys, with soft-capped scores and with attention sinks
    (`sinks` [H]: head h's softmax denominator gains exp(sinks[h]); head h reads KV head
    h // (H / Hkv)) when given: the same meaning as the torch path. Rows past
    `query_start_loc[-1]` (token padding) are left zero."""
    assert sliding_window is None or sliding_window > 0, f"sliding_window {sliding_window}"
    assert logits_soft_cap is None or logits_soft_cap > 0, f"logits_soft_cap {logits_soft_cap}"
    _check_args(query, key_cache, value_cache, attn_metadata)
    if sinks is not None:
        check_tensor("sinks", sinks, (query.shape[1],), FLOAT_DTYPES)
        check_same_device(query=query, sinks=sinks)
    md = attn_metadata
    out = torch.empty_like(query)
    num_tokens_used = md.query_start_loc_cpu[-1]
    if num_tokens_used < query.shape[0]:
        out[num_tokens_used:].zero_()
    if md.num_decodes > 0:
        decode_attention(query[: md.num_decodes], key_cache, value_cache, md.block_tables,
                         md.seq_lens, scale, out[: md.num_decodes], md.max_seq_len, num_splits,
                         sliding_window, logits_soft_cap, sinks)
    if md.num_reqs > md.num_decodes:
        prefill_attention(query, key_cache, value_cache, md.block_tables, md.seq_lens,
                          md.query_start_loc, scale, out, md.num_decodes, md.num_reqs,
                          md.max_query_len, sliding_window, logits_soft_cap, sinks)
    return out
