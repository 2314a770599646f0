"""An FP8 KV cache (`--kv-cache-dtype fp8`): keys and values stored as float8_e4m3fn.

Each stored value is `clamp(x / scale, +-448)` rounded to float8_e4m3fn and read back
as `stored * scale`, one scale per cache. The scale is 1.0, vLLM's default when a
checkpoint carries no calibrated `k_scale`/`v_scale` (none of ours do): keys and
values of the models served are far inside the e4m3 range, so the clamp only guards
against overflow to NaN, and the loss is the rounding to a 3-bit mantissa.

This is the torch path, used on every device: writes go through a uint8 view of the
cache (index_copy_ on raw bytes), and attention first gathers the blocks of this
step's block tables, dequantized to the query dtype, into a dense scratch cache with
an identity block table, then runs the usual paged attention on it. Shapes depend
only on the block table's shape, never on its values, so CUDA graphs capture it.
The cost over a model-dtype cache: per layer and step, one dequantizing copy of the
blocks the batch's block tables name (transient memory of that size).
"""

from __future__ import annotations

import dataclasses

import torch

from pagoda.model.attention_metadata import AttentionMetadata

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_SCALE = 1.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def write_kv_cache_fp8(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize key/value [T, Hkv, D] and store them at flat slots `slot_mapping` [T]."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    for x, cache in ((key, key_cache), (value, value_cache)):
        q = (x.float() / KV_SCALE).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, q.view(torch.uint8))


def dequantize_blocks(cache: torch.Tensor, block_ids: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """cache[block_ids] as `dtype`: [len(block_ids), block_size, Hkv, D]."""
    return (cache[block_ids].to(torch.float32) * KV_SCALE).to(dtype)


def dense_step_cache(key_cache: torch.Tensor, value_cache: torch.Tensor,
                     md: AttentionMetadata, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The blocks this step's block tables name, dequantized, and metadata whose block
    table points at them (request r's column c is scratch block r * width + c)."""
    tables = md.block_tables
    block_ids = tables.reshape(-1).long()
    scratch_table = torch.arange(block_ids.numel(), dtype=tables.dtype,
                                 device=tables.device).view(tables.shape)
    return (dequantize_blocks(key_cache, block_ids, dtype),
            dequantize_blocks(value_cache, block_ids, dtype),
            dataclasses.replace(md, block_tables=scratch_table))
