"""The FP8 KV cache: keys and values stored as float8_e4m3fn (scale 1.0), attention over
them equal to attention over the same values in a model-dtype cache."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.testing import random_paged_batch
from pagoda.model import ops
from pagoda.model.fp8_kv_cache import FP8_KV_DTYPE
from pagoda.model.kv_cache import (allocate_kv_caches, kv_cache_bytes_per_block,
                                   kv_cache_torch_dtype, resolve_kv_cache_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_an_fp8_cache_equals_attention_over_its_values(dtype):
    # Decodes and a chunked prefill behind a cached prefix, blocks scattered.
    batch = random_paged_batch([(9, 1), (30, 1), (5, 7), (0, 12)], num_heads=4, num_kv_heads=2,
                               head_dim=16, block_size=4, dtype=dtype, seed=3)
    fp8_key = batch.key_cache.to(FP8_KV_DTYPE)
    fp8_value = batch.value_cache.to(FP8_KV_DTYPE)
    ops.write_kv_cache(batch.key, batch.value, fp8_key, fp8_value, batch.attn_metadata.slot_mapping)
    # The same values in a model-dtype cache: what fp8 holds, written as fp8 rounds them.
    key_cache, value_cache = fp8_key.to(dtype), fp8_value.to(dtype)
    written = batch.key.to(FP8_KV_DTYPE).to(dtype)
    slots = batch.attn_metadata.slot_mapping
    assert torch.equal(key_cache.view(-1, 2, 16)[slots], written)
    out = ops.paged_attention(batch.query, fp8_key, fp8_value, batch.attn_metadata, 0.25)
    expected = ops.paged_attention(batch.query, key_cache, value_cache, batch.attn_metadata, 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_values_beyond_the_fp8_range_saturate_instead_of_becoming_nan():
    key = torch.tensor([[[1000.0, -1000.0, 1.0, 0.0]]])
    cache = torch.zeros(1, 4, 1, 4, dtype=FP8_KV_DTYPE)
    ops.write_kv_cache(key, key, cache, cache.clone(), torch.tensor([2]))
    assert cache[0, 2, 0].float().tolist() == [448.0, -448.0, 1.0, 0.0]


def test_fp8_cache_dtype_halves_a_bf16_cache_and_is_cuda_only(tiny_llama_dir):
    from pagoda.model.loader import load_arch_config

    arch = load_arch_config(tiny_llama_dir)
    fp8 = kv_cache_torch_dtype("fp8", torch.bfloat16)
    assert fp8 == FP8_KV_DTYPE and kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_bytes_per_block(arch, 16, fp8) * 2 == kv_cache_bytes_per_block(
        arch, 16, torch.bfloat16)
    assert allocate_kv_caches(arch, 2, 16, fp8, "cpu")[0][0].dtype == FP8_KV_DTYPE
    assert resolve_kv_cache_dtype("fp8_e4m3", "cuda") == "fp8"
    assert resolve_kv_cache_dtype("auto", "cpu") == "auto"
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs a CUDA device"):
        resolve_kv_cache_dtype("fp8", "cpu")
    with pytest.raises(ValueError, match="Unknown kv_cache_dtype 'int8'"):
        resolve_kv_cache_dtype("int8", "cuda")
