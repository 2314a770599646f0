"""KV-cache write: scatter this step's keys/values into their slots.

Cache layout (see `pagoda.kernels.attention_metadata`): `[num_blocks, block_size,
num_kv_heads, head_dim]`; slot `s` is block `s // block_size`, offset
`s % block_size`. One program per token writes all its heads; a negative slot marks a
padding token (CUDA-graph padding) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor, next_power_of_2


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64
) -> None:
    """Write `key[t]`, `value[t]` into slot `slot_mapping[t]` of the caches, in place."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    check_tensor("key", key, (num_tokens, num_kv_heads, head_dim), FLOAT_DTYPES)
    check_tensor("value", value, (num_tokens, num_kv_heads, head_dim), (key.dtype,))
    check_tensor("key_cache", key_cache, (None, block_size, num_kv_heads, head_dim), (key.dtype,))
    check_tensor("value_cache", value_cache, tuple(key_cache.shape), (key.dtype,))
    check_tensor("slot_mapping", slot_mapping, (num_tokens,), (torch.int32, torch.int64))
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
    )
