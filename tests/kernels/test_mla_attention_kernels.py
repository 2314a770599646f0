"""MLA-shaped inputs (DeepSeek) through the Triton paged attention, against the reference.

`pagoda.model.mla_attention` runs the absorbed form: query heads of width
kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3: not a power of two) over ONE
KV head, the latent cache, passed as both key and value cache (the same tensor; the
caller keeps the first kv_lora_rank output columns). The kernels pad 576 to 1024
lanes and, at that width, cut a KV head's query heads into programs of 16
(`paged_decode._MAX_GROUP_TILE`), so 32 heads take two programs per KV head.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import reference as ref
from pagoda.kernels.attention import paged_attention
from pagoda.kernels.kv_cache import write_kv_cache
from pagoda.kernels.paged_decode import choose_num_splits
from pagoda.kernels.testing import random_paged_batch, relative_error

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (kv_lora_rank + qk_rope_head_dim, query heads): V3's 512 + 64, a small 64 + 32, and V3's
# width with more heads than one program holds.
SHAPES = [(576, 16), (96, 16), (576, 32)]


def mla_batch(requests, head_dim, heads, dtype, device, seed=0):
    """One latent cache as key and value, each token's latent written once to it."""
    batch = random_paged_batch(requests, heads, 1, head_dim, block_size=16, dtype=dtype,
                               device=device, seed=seed)
    batch.value_cache = batch.key_cache
    write_kv_cache(batch.key, batch.key, batch.key_cache, batch.key_cache,
                   batch.attn_metadata.slot_mapping)
    batch.query.mul_(head_dim ** -0.25)  # scores of order one at the real scale
    return batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads", SHAPES)
def test_mla_shaped_mixed_step(device, dtype, head_dim, heads):
    # Decodes (one long enough for the heuristic's split-K is in the next test), a fresh
    # prefill, a chunk behind a cached prefix.
    requests = [(20, 1), (0, 1), (0, 9), (17, 20)]
    batch = mla_batch(requests, head_dim, heads, dtype, device, seed=head_dim + heads)
    md, scale = batch.attn_metadata, head_dim ** -0.5
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, md, scale)
    expected = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, scale)
    assert out.shape == batch.query.shape
    assert relative_error(out, expected) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [None, 3])
def test_mla_shaped_split_decode(device, num_splits):
    # 2 requests x 2 group programs: the heuristic splits a 601-key context in 2.
    assert choose_num_splits(2, 2, 601, torch.device(device)) > 1
    batch = mla_batch([(600, 1), (40, 1)], 576, 32, torch.float32, device, seed=3)
    md, scale = batch.attn_metadata, 576 ** -0.5
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, md, scale,
                          num_splits=num_splits)
    expected = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, scale)
    assert relative_error(out, expected) < 1e-5
