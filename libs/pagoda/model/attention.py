"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

Layouts are those of `attention_metadata.py`: a step's T tokens are flattened
request by request, decodes first; each layer's cache is a pair of
`[num_blocks, block_size, num_kv_heads, head_dim]` tensors.

Decodes are computed together: one gather of every decode's blocks (up to the
longest decode) and one masked SDPA, with the query heads of a KV head laid out
as SDPA's "query length" so GQA needs no copy of K/V:

    q [num_decodes, num_kv_heads, group, D]  x  K [num_decodes, num_kv_heads, L, D]

Prefills (full, chunked, or behind a cached prefix) run one SDPA per request; query
i sits at position context_len + i and sees keys 0..context_len + i: `is_causal` when
there is no cached context (SDPA's top-left diagonal is then the right one), an
explicit mask otherwise.

Batch invariance (`AttentionMetadata.batch_invariant`): a token's attention output
must not depend on the batch, the chunking or a prefix-cache hit. With a per-row decode
kernel (`decode_kernel`: the fused bf16 CPU kernel, whose reduction over a row's keys
runs in a fixed order that depends on that row alone) every query token of the step,
prompt tokens included, is one row of that kernel: keys 0..its position, through its
request's block table (`_token_rows`). Prefill and decode then share one arithmetic,
so nothing else is needed. Without the kernel (other dtypes, PAGODA_CPU_KERNELS=0),
SDPA is made invariant as follows. CPU SDPA's rounding
depends on how many keys it reads past the visible ones (masked keys still shape
its loops), and, with fewer than 4 rows, on the query count. Found by measurement
(tests/model/test_batch_invariance.py): reading keys in whole multiples of SDPA's
512-key split, and giving it at least 4 query rows, makes each row's result depend
on its own query and keys only. So in that mode every path reads keys up to the
next multiple of 512 (decodes: of the longest decode; a prefill: of its last
query), decodes pad their group of query heads to 4 rows and a prefill repeats its
last query until its last query block has 4 rows (`_padded_query_rows`). Without
the mode, reads stop at the last whole block. Sliding-window layers start their
gather at a block that depends on the first query: not covered.

A sliding window W (Mistral, Gemma's local layers) narrows that to the keys
`p - W < k <= p` of a query at position p (transformers' mask). Only the blocks
holding such keys are gathered, so the work per token stays bounded, and entries of
the block table before the window are never read: the KV cache manager may have
freed those blocks. Soft-capping (Gemma 2) bounds each score as `cap * tanh(s / cap)`
before the mask; SDPA cannot do that, so those layers take an explicit softmax.
Attention sinks (gpt-oss) are one learned logit per query head that joins every
row's softmax as an extra key with no value: the row's weights then sum to less than
one. They take the same explicit softmax, never the CPU decode kernel (which has no
sinks); layers without sinks or a cap keep SDPA, so their outputs are unchanged by the
option. Batch invariance of the explicit path is not measured: not covered either.

The cache must hold finite values everywhere (allocate it zeroed): padded block
table entries are gathered and masked, and a masked NaN would still poison SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.model.attention_metadata import AttentionMetadata

_PLAN_ATTR = "_torch_attention_plan"
# Batch-invariant mode reads keys in multiples of this (CPU SDPA's key split): see
# "Batch invariance" in the module doc.
BATCH_INVARIANT_KEY_GRANULE = 512


def _num_key_blocks(md: AttentionMetadata, seq_len: int, block_size: int) -> int:
    """Blocks to read for `seq_len` keys: whole blocks, in batch-invariant mode a whole
    number of key splits."""
    granule = 1
    if md.batch_invariant:
        granule = max(BATCH_INVARIANT_KEY_GRANULE // block_size, 1)
    return -(-seq_len // (granule * block_size)) * granule


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, num_kv_heads, head_dim] at flat slots `slot_mapping` [T] (int64)."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@dataclass
class _PrefillPlan:
    """One request's queries [query_start, query_end) of the flattened step over the
    whole blocks `block_ids` (key positions from key_start)."""

    query_start: int
    query_end: int
    key_start: int  # position of the first gathered key (0, or the window's first block)
    block_ids: torch.Tensor  # [num_gathered_blocks] int32
    mask: torch.Tensor | None  # [q, num_gathered_blocks * block_size] bool; None: causal


@dataclass
class _Plan:
    """Index tensors derived from the metadata once per step and shared by all layers
    with the same block size and window."""

    decode_block_ids: torch.Tensor | None  # [num_decodes * blocks_per_decode]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, L] bool, L = blocks * block_size
    prefills: list[_PrefillPlan]


def _decode_plan(md: AttentionMetadata, block_size: int, window: int | None):
    """Each decode's blocks from the first one its window touches (block 0 without a
    window), the same count for all, with a mask of the keys it may see."""
    nd = md.num_decodes
    seq_lens = md.seq_lens[:nd].long()
    num_blocks = _num_key_blocks(md, max(md.seq_lens_cpu[:nd]), block_size)
    first_block = torch.zeros_like(seq_lens)
    if window is not None:
        # Keys p - W < k <= p span at most ceil(W / block_size) + 1 blocks.
        num_blocks = min(num_blocks, -(-window // block_size) + 1)
        first_block = (seq_lens - window).clamp(min=0) // block_size
    columns = first_block[:, None] + torch.arange(num_blocks, device=seq_lens.device)
    # Columns past the table's width only hold positions >= seq_len: masked below.
    table = md.block_tables[:nd]
    block_ids = table.gather(1, columns.clamp(max=table.shape[1] - 1)).reshape(-1)
    key_pos = (columns[:, :, None] * block_size
               + torch.arange(block_size, device=seq_lens.device)).reshape(nd, -1)
    visible = key_pos < seq_lens[:, None]
    if window is not None:
        visible &= key_pos > seq_lens[:, None] - 1 - window
    return block_ids, visible[:, None, None, :]


def _prefill_plan(md: AttentionMetadata, i: int, block_size: int,
                  window: int | None) -> _PrefillPlan:
    start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
    seq_len = md.seq_lens_cpu[i]
    context_len = seq_len - (end - start)
    key_start = 0
    if window is not None:  # from the block of the first key the first query sees
        key_start = max(0, context_len - window + 1) // block_size * block_size
    first_block, num_blocks = key_start // block_size, _num_key_blocks(md, seq_len, block_size)
    mask = None  # no context: causal from the top-left corner also masks the tail
    if context_len or window is not None:
        device = md.block_tables.device
        q_pos = torch.arange(context_len, seq_len, device=device)[:, None]
        k_pos = torch.arange(key_start, num_blocks * block_size, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
    table = md.block_tables[i]
    columns = torch.arange(first_block, num_blocks, device=table.device).clamp(max=table.shape[0] - 1)
    return _PrefillPlan(start, end, key_start, table[columns], mask)


def _make_plan(md: AttentionMetadata, block_size: int, window: int | None,
               with_decodes: bool) -> _Plan:
    decode_block_ids = decode_mask = None
    if md.num_decodes and with_decodes:
        decode_block_ids, decode_mask = _decode_plan(md, block_size, window)
    prefills = [_prefill_plan(md, i, block_size, window)
                for i in range(md.num_decodes, md.num_reqs)]
    return _Plan(decode_block_ids, decode_mask, prefills)


def _step_memo(md: AttentionMetadata) -> dict:
    # Memoised on the metadata object, which lives for exactly one step, so the
    # 30-odd layers of a model do not rebuild the same index tensors.
    plans = getattr(md, _PLAN_ATTR, None)
    if plans is None:
        plans = {}
        try:
            setattr(md, _PLAN_ATTR, plans)
        except AttributeError:  # a slotted/frozen metadata: correct, just rebuilt per layer
            pass
    return plans


def _get_plan(md: AttentionMetadata, block_size: int, window: int | None,
              with_decodes: bool = True) -> _Plan:
    # Keyed by the window: Gemma's local and global layers need different plans.
    plans = _step_memo(md)
    key = (block_size, window, with_decodes)
    if key not in plans:
        plans[key] = _make_plan(md, block_size, window, with_decodes)
    return plans[key]


def _token_rows(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table [T, W], keys seen [T]) of every query token, as decode rows: token j
    of a request with q query tokens and seq_len keys sees its first seq_len - q + j + 1.
    Memoised on the step's metadata like the plans."""
    plans = _step_memo(md)
    if "token_rows" in plans:
        return plans["token_rows"]
    starts = md.query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]
    num_tokens = md.query_start_loc_cpu[-1]
    request = torch.repeat_interleave(torch.arange(md.num_reqs, device=starts.device),
                                      query_lens, output_size=num_tokens)
    offset = torch.arange(num_tokens, device=starts.device) - starts[request]
    seen = md.seq_lens.long()[request] - query_lens[request] + offset + 1
    plans["token_rows"] = (md.block_tables.index_select(0, request).contiguous(),
                           seen.to(torch.int32))
    return plans["token_rows"]


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks `block_ids` of a cache, concatenated: [len(block_ids) * block_size, Hkv, D]."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_ids)
    return rows.view(-1, num_kv_heads, head_dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, soft_cap: float | None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [..., Lq, D] x [..., Lk, D]; `mask` None means causal from the top-left
    corner. With a soft cap or sinks (broadcastable to [..., Lq, 1]: one logit per query
    row's head), the explicit form transformers' eager attention uses (softmax in fp32;
    a sink's column is dropped after the softmax)."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1,
                              dtype=torch.float32)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


# See "Batch invariance": CPU SDPA's query block sizes, and the fewest rows a block
# may hold and still round like a full one.
_MIN_BLOCK_ROWS = 4


def _query_block_rows(num_query: int) -> int:
    return 256 if num_query >= 768 else 64 if num_query >= 192 else 32


def _padded_query_rows(num_query: int) -> int:
    """The least n >= num_query whose last query block has at least _MIN_BLOCK_ROWS rows."""
    n = num_query
    while 0 < n % _query_block_rows(n) < _MIN_BLOCK_ROWS:
        n += 1
    return n


def _pad_rows(x: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """x with its last entry along `dim` repeated up to `rows` entries."""
    extra = rows - x.shape[dim]
    if extra == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    shape = list(last.shape)
    shape[dim] = extra
    return torch.cat([x, last.expand(shape)], dim=dim)


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      plan: _Plan, scale: float, soft_cap: float | None,
                      invariant: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    # [nd, L, Hkv, D] -> [nd, Hkv, L, D] as a strided view; SDPA takes it as is.
    key = _gather(key_cache, plan.decode_block_ids).view(num_decodes, -1, num_kv_heads, head_dim)
    value = _gather(value_cache, plan.decode_block_ids).view(num_decodes, -1, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    q = query.view(num_decodes, num_kv_heads, group, head_dim)
    if invariant:
        q = _pad_rows(q, max(group, _MIN_BLOCK_ROWS), 2)
    if sinks is not None:  # head h = kv head * group + g, as the query rows: [1, Hkv, G, 1]
        sinks = _pad_rows(sinks.view(num_kv_heads, group), q.shape[2], 1)[None, :, :, None]
    out = _attend(q, key.transpose(1, 2), value.transpose(1, 2), plan.decode_mask, scale,
                  soft_cap, sinks)
    return out[:, :, :group].reshape(num_decodes, num_heads, head_dim)


def _prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       p: _PrefillPlan, scale: float, soft_cap: float | None,
                       invariant: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    num_query, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    key = _gather(key_cache, p.block_ids)  # whole blocks: see "Batch invariance" above
    value = _gather(value_cache, p.block_ids)
    num_keys = key.shape[0]
    # GQA without copying K/V: batch over KV heads, expand K/V over the group with
    # stride 0. 4-D inputs matter: CPU SDPA takes its fast flash path only for them.
    rows = _padded_query_rows(num_query) if invariant else num_query
    q = _pad_rows(query.view(num_query, num_kv_heads, group, head_dim), rows, 0)
    q = q.permute(1, 2, 0, 3)
    k = key.permute(1, 0, 2)[:, None].expand(num_kv_heads, group, num_keys, head_dim)
    v = value.permute(1, 0, 2)[:, None].expand(num_kv_heads, group, num_keys, head_dim)
    # Causal (mask None) from the top-left: padded rows see one more key each, harmless.
    mask = _pad_rows(p.mask, rows, 0) if p.mask is not None else None
    if sinks is not None:  # [Hkv, group, 1, 1], as q's heads
        sinks = sinks.view(num_kv_heads, group, 1, 1)
    out = _attend(q, k, v, mask, scale, soft_cap, sinks)
    return out[:, :, :num_query].permute(2, 0, 1, 3).reshape(num_query, num_heads, head_dim)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float,
                    sliding_window: int | None = None,
                    logits_soft_cap: float | None = None,
                    decode_kernel: Callable[..., torch.Tensor] | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of query [T, H, D] over each request's cached context -> [T, H, D].

    The step's own keys/values must already be in the cache (`write_kv_cache`).
    Query head h reads KV head h // (H // num_kv_heads), as HF's `repeat_kv`. With
    `sliding_window` W a query at position p sees keys p - W < k <= p; with
    `logits_soft_cap` c each score s becomes c * tanh(s / c) (see module doc).
    `decode_kernel` (`pagoda.kernels.cpu.paged_decode_attention`'s signature), when
    given, computes the decodes straight over the cache instead of gather + SDPA; it
    has no sinks, so `sinks` ([H] logits, one per query head) requires it to be None.
    """
    if sinks is not None and decode_kernel is not None:
        raise ValueError("attention sinks are not supported by the CPU decode kernel")
    if decode_kernel is not None and attn_metadata.batch_invariant:
        tables, seen = _token_rows(attn_metadata)  # every token a decode row: module doc
        return decode_kernel(query, key_cache, value_cache, tables, seen, scale,
                             sliding_window, logits_soft_cap)
    nd = attn_metadata.num_decodes
    plan = _get_plan(attn_metadata, key_cache.shape[1], sliding_window,
                     with_decodes=decode_kernel is None)
    outputs = []
    if nd and decode_kernel is not None:
        outputs.append(decode_kernel(query[:nd], key_cache, value_cache,
                                     attn_metadata.block_tables, attn_metadata.seq_lens, scale,
                                     sliding_window, logits_soft_cap))
    elif nd:
        outputs.append(_decode_attention(query[:nd], key_cache, value_cache, plan, scale,
                                         logits_soft_cap, attn_metadata.batch_invariant, sinks))
    for p in plan.prefills:
        outputs.append(_prefill_attention(query[p.query_start:p.query_end], key_cache,
                                          value_cache, p, scale, logits_soft_cap,
                                          attn_metadata.batch_invariant, sinks))
    if len(outputs) == 1:
        # A lone prefill's [H, Q, D] result permuted to [Q, H, D] is a strided view, which
        # the caller's `view(T, H * D)` cannot take (SDPA's output happens to permute back
        # contiguous; the explicit softcap/sinks form's does not): one layout for all.
        return outputs[0].contiguous()
    return torch.cat(outputs) if outputs else torch.empty_like(query)
