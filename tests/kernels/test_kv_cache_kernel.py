"""KV-cache write kernel against the reference scatter."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import reference as ref
from pagoda.kernels.kv_cache import write_kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 16, 4), (3, 24, 5), (8, 16, 16)])
def test_write_kv_cache_matches_reference(device, dtype, num_kv_heads, head_dim, block_size):
    torch.manual_seed(0)
    num_blocks, num_tokens = 6, 11
    # Key/value as strided views of one fused qkv projection, as the model produces them.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, dtype=dtype, device=device)
    key = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1  # a padding token: must not be written anywhere
    slots = slots.to(device)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()

    write_kv_cache(key, value, key_cache, value_cache, slots)
    ref.write_kv_cache(key, value, expected_k, expected_v, slots)

    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)
    # Non-trivial: the write changed the cache at exactly the non-padding slots.
    flat = key_cache.view(-1, num_kv_heads, head_dim)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], key[t])


def test_write_kv_cache_rejects_mismatched_shapes(device):
    key = torch.randn(4, 2, 16, device=device)
    cache = torch.zeros(3, 4, 2, 16, device=device)
    with pytest.raises(AssertionError, match="dim 1 is 2, expected 3"):
        write_kv_cache(key, key, torch.zeros(3, 4, 3, 16, device=device), cache,
                       torch.arange(4, device=device))
    with pytest.raises(AssertionError, match="slot_mapping"):
        write_kv_cache(key, key, cache, cache.clone(), torch.arange(5, device=device))
    with pytest.raises(AssertionError, match="dtype"):
        write_kv_cache(key.bfloat16(), key.bfloat16(), cache, cache.clone(),
                       torch.arange(4, device=device))
