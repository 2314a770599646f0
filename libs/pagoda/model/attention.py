"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

Layouts are those of `attention_metadata.py`: a step's T tokens are flattened
request by request, decodes first; each layer's cache is a pair of
`[num_blocks, block_size, num_kv_heads, head_dim]` tensors.

Decodes are computed together: one gather of every decode's blocks (up to the
longest decode) and one masked SDPA, with the query heads of a KV head laid out
as SDPA's "query length" so GQA needs no copy of K/V:

    q [num_decodes, num_kv_heads, group, D]  x  K [num_decodes, num_kv_heads, L, D]

Prefills (full, chunked, or behind a cached prefix) run one SDPA per request,
causal with the diagonal shifted by the cached length (query i sits at position
context_len + i and sees keys 0..context_len + i).

The cache must hold finite values everywhere (allocate it zeroed): padded block
table entries are gathered and masked, and a masked NaN would still poison SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.model.attention_metadata import AttentionMetadata

_PLAN_ATTR = "_torch_attention_plan"


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, num_kv_heads, head_dim] at flat slots `slot_mapping` [T] (int64)."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@dataclass
class _PrefillPlan:
    query_start: int
    query_end: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks_of_request] int32
    mask: torch.Tensor | None  # [q, seq_len] bool when there is a cached prefix; else causal


@dataclass
class _Plan:
    """Index tensors derived from the metadata once per step and shared by all layers."""

    block_size: int
    decode_block_ids: torch.Tensor | None  # [num_decodes * blocks_per_decode]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, L] bool, L = blocks * block_size
    prefills: list[_PrefillPlan]


def _make_plan(md: AttentionMetadata, block_size: int) -> _Plan:
    nd = md.num_decodes
    device = md.block_tables.device
    decode_block_ids = decode_mask = None
    if nd:
        num_blocks = -(-max(md.seq_lens_cpu[:nd]) // block_size)
        decode_block_ids = md.block_tables[:nd, :num_blocks].reshape(-1)
        key_pos = torch.arange(num_blocks * block_size, device=device)
        decode_mask = (key_pos[None, :] < md.seq_lens[:nd, None])[:, None, None, :]
    prefills = []
    for i in range(nd, md.num_reqs):
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        seq_len = md.seq_lens_cpu[i]
        num_query = end - start
        mask = None
        if seq_len != num_query:
            mask = torch.ones(num_query, seq_len, dtype=torch.bool, device=device)
            mask = mask.tril(diagonal=seq_len - num_query)
        block_ids = md.block_tables[i, :-(-seq_len // block_size)]
        prefills.append(_PrefillPlan(start, end, seq_len, block_ids, mask))
    return _Plan(block_size, decode_block_ids, decode_mask, prefills)


def _get_plan(md: AttentionMetadata, block_size: int) -> _Plan:
    # Memoised on the metadata object, which lives for exactly one step, so the
    # 30-odd layers of a model do not rebuild the same index tensors.
    plan = getattr(md, _PLAN_ATTR, None)
    if plan is None or plan.block_size != block_size:
        plan = _make_plan(md, block_size)
        try:
            setattr(md, _PLAN_ATTR, plan)
        except AttributeError:  # a slotted/frozen metadata: correct, just rebuilt per layer
            pass
    return plan


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks `block_ids` of a cache, concatenated: [len(block_ids) * block_size, Hkv, D]."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_ids)
    return rows.view(-1, num_kv_heads, head_dim)


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      plan: _Plan, scale: float) -> torch.Tensor:
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    # [nd, L, Hkv, D] -> [nd, Hkv, L, D] as a strided view; SDPA takes it as is.
    key = _gather(key_cache, plan.decode_block_ids).view(num_decodes, -1, num_kv_heads, head_dim)
    value = _gather(value_cache, plan.decode_block_ids).view(num_decodes, -1, num_kv_heads, head_dim)
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=plan.decode_mask, scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def _prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       p: _PrefillPlan, scale: float) -> torch.Tensor:
    num_query, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    key = _gather(key_cache, p.block_ids)[:p.seq_len]
    value = _gather(value_cache, p.block_ids)[:p.seq_len]
    # GQA without copying K/V: batch over KV heads, expand K/V over the group with
    # stride 0. 4-D inputs matter: CPU SDPA takes its fast flash path only for them.
    q = query.view(num_query, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    k = key.permute(1, 0, 2)[:, None].expand(num_kv_heads, group, p.seq_len, head_dim)
    v = value.permute(1, 0, 2)[:, None].expand(num_kv_heads, group, p.seq_len, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.mask is None,
                                         scale=scale)
    return out.permute(2, 0, 1, 3).reshape(num_query, num_heads, head_dim)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of query [T, H, D] over each request's cached context -> [T, H, D].

    The step's own keys/values must already be in the cache (`write_kv_cache`).
    Query head h reads KV head h // (H // num_kv_heads), as HF's `repeat_kv`.
    """
    plan = _get_plan(attn_metadata, key_cache.shape[1])
    nd = attn_metadata.num_decodes
    outputs = []
    if nd:
        outputs.append(_decode_attention(query[:nd], key_cache, value_cache, plan, scale))
    for p in plan.prefills:
        outputs.append(_prefill_attention(query[p.query_start:p.query_end], key_cache,
                                          value_cache, p, scale))
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat(outputs) if outputs else torch.empty_like(query)
