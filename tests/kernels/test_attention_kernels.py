"""Paged attention (decode split-K + prefill over paged KV) against the dense reference.

Every batch scatters its blocks at random over the cache, so a kernel that ignored
the block table, the cached prefix or the causal offset would read the wrong keys.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import reference as ref
from pagoda.kernels.attention import paged_attention
from pagoda.kernels.kv_cache import write_kv_cache
from pagoda.kernels.paged_decode import choose_num_splits
from pagoda.kernels.testing import random_paged_batch, relative_error

# (heads, kv_heads): GQA ratios 1, 3 and 8.
GQA = [(4, 4), (6, 2), (8, 1)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def run_both(batch, scale=0.25, num_splits=None):
    write_kv_cache(batch.key, batch.value, batch.key_cache, batch.value_cache,
                   batch.attn_metadata.slot_mapping)
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.attn_metadata,
                          scale, num_splits=num_splits)
    expected = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                   batch.attn_metadata, scale)
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_mixed_batch_decodes_prefills_and_prefix_cached_chunks(device, dtype, heads, kv_heads):
    # Decodes first (one short, one spanning many blocks, one with an empty prefix),
    # then a fresh prefill, a chunk after a 9-token cached prefix, an odd-length chunk
    # that starts mid-block, and a prefill longer than one query tile.
    requests = [(5, 1), (40, 1), (0, 1), (0, 7), (9, 13), (16, 21), (3, 35)]
    batch = random_paged_batch(requests, heads, kv_heads, head_dim=24, block_size=4,
                               dtype=dtype, device=device, seed=heads)
    out, expected = run_both(batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert relative_error(out, expected) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_decode_split_k_gives_the_same_result_for_any_split_count(device, num_splits):
    # 8 splits of a 3-tile context leave some splits empty; the reduce must ignore them.
    requests = [(70, 1), (2, 1), (33, 1)]
    batch = random_paged_batch(requests, 6, 2, head_dim=16, block_size=4, device=device, seed=1)
    out, expected = run_both(batch, num_splits=num_splits)
    assert relative_error(out, expected) < 1e-5


def test_prefill_causal_mask_respects_cached_prefix(device):
    # The same 6 query tokens with and without an 11-token cached prefix must differ:
    # with the prefix, every query also attends to the prefix keys.
    with_prefix = random_paged_batch([(11, 6)], 4, 4, head_dim=16, block_size=5, device=device, seed=2)
    out, expected = run_both(with_prefix)
    assert relative_error(out, expected) < 1e-5
    # Query i sees keys 0 .. 11 + i: check the first query against a hand computation.
    md = with_prefix.attn_metadata
    k = ref.gather_kv(with_prefix.key_cache, md.block_tables[0], 12).float()[:, 0]
    v = ref.gather_kv(with_prefix.value_cache, md.block_tables[0], 12).float()[:, 0]
    q0 = with_prefix.query[0, 0].float()
    manual = torch.softmax(k @ q0 * 0.25, dim=0) @ v
    torch.testing.assert_close(out[0, 0].float(), manual, rtol=1e-5, atol=1e-5)


def test_padding_requests_and_padding_tokens_yield_zeros(device):
    # CUDA-graph padding: a request with seq_len 0 and tokens past query_start_loc[-1].
    batch = random_paged_batch([(7, 1), (0, 1)], 4, 2, head_dim=16, block_size=4, device=device)
    md = batch.attn_metadata
    md.seq_lens[1] = 0
    md.seq_lens_cpu[1] = 0
    md.slot_mapping[1] = -1
    query = torch.cat([batch.query, torch.randn_like(batch.query[:1])])
    write_kv_cache(batch.key, batch.value, batch.key_cache, batch.value_cache, md.slot_mapping)
    out = paged_attention(query, batch.key_cache, batch.value_cache, md, 0.25, num_splits=2)
    expected = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, 0.25)
    assert relative_error(out[:1], expected[:1]) < 1e-5
    assert torch.count_nonzero(out[1:]) == 0


def test_rejects_inconsistent_arguments(device):
    batch = random_paged_batch([(3, 1), (0, 4)], 4, 2, head_dim=16, block_size=4, device=device)
    md = batch.attn_metadata
    with pytest.raises(AssertionError, match="multiple of"):
        paged_attention(batch.query[:, :3], batch.key_cache, batch.value_cache, md, 1.0)
    with pytest.raises(AssertionError, match="dtype"):
        paged_attention(batch.query.bfloat16(), batch.key_cache, batch.value_cache, md, 1.0)
    md.num_decodes = 2  # the second request has 4 query tokens: not a decode
    with pytest.raises(AssertionError, match="decodes"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, md, 1.0)


def test_num_splits_heuristic_splits_long_contexts_of_small_batches_only():
    cpu = torch.device("cpu")  # counts as 4 SMs
    assert choose_num_splits(1, 1, 100, cpu) == 1  # too short to split
    assert choose_num_splits(1, 1, 4096, cpu) == 8  # 2 programs per SM
    assert choose_num_splits(64, 8, 4096, cpu) == 1  # enough programs already
    # A power of two, so a context growing step by step compiles few kernel variants.
    assert {choose_num_splits(1, 1, n, cpu) for n in range(1, 3000, 7)} == {1, 2, 4, 8}


@pytest.mark.cuda
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (32, 32)])
def test_realistic_shapes_on_gpu(heads, kv_heads):
    requests = [(1000, 1), (4000, 1), (17, 1), (0, 300), (500, 129)]
    batch = random_paged_batch(requests, heads, kv_heads, head_dim=128, block_size=16,
                               dtype=torch.bfloat16, device="cuda")
    out, expected = run_both(batch, scale=128**-0.5)
    assert relative_error(out, expected) < 2e-2


def poison_blocks_out_of_window(batch, window: int) -> None:
    """Point every block-table entry wholly before a request's window at a NaN block, as
    the KV cache manager's released blocks may hold anything: a kernel that loaded one
    (even masked) would turn its output into NaN."""
    md = batch.attn_metadata
    block_size = batch.key_cache.shape[1]
    used = set(md.block_tables.flatten().tolist())
    nan_block = next(b for b in range(batch.key_cache.shape[0]) if b not in used)
    batch.key_cache[nan_block] = float("nan")
    batch.value_cache[nan_block] = float("nan")
    qsl = md.query_start_loc_cpu
    for i, seq_len in enumerate(md.seq_lens_cpu):
        first_query = seq_len - (qsl[i + 1] - qsl[i])
        num_out = max(0, first_query - window + 1) // block_size
        md.block_tables[i, :num_out] = nan_block


# Decodes whose windows start mid-block and past several blocks, a prefill longer than
# the window, a chunk behind a cached prefix longer than the window.
WINDOW_REQUESTS = [(3, 1), (21, 1), (40, 1), (0, 19), (26, 9)]


@pytest.mark.parametrize("window", [1, 6, 13])
def test_sliding_window_matches_reference_and_never_reads_released_blocks(device, window):
    batch = random_paged_batch(WINDOW_REQUESTS, 6, 2, head_dim=16, block_size=4, device=device,
                               seed=window)
    md = batch.attn_metadata
    write_kv_cache(batch.key, batch.value, batch.key_cache, batch.value_cache, md.slot_mapping)
    expected = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, 0.25,
                                   sliding_window=window)
    full = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, 0.25)
    assert relative_error(full, expected) > 1e-2  # the window really cuts keys off
    poison_blocks_out_of_window(batch, window)
    for num_splits in (1, 3):
        out = paged_attention(batch.query, batch.key_cache, batch.value_cache, md, 0.25,
                              num_splits=num_splits, sliding_window=window)
        assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_match_reference(device, dtype):
    # Large queries so that the cap (5) really bends the scores; with a window too.
    batch = random_paged_batch([(9, 1), (0, 1), (5, 11)], 4, 2, head_dim=16, block_size=4,
                               dtype=dtype, device=device, seed=5)
    batch.query.mul_(4)
    md = batch.attn_metadata
    write_kv_cache(batch.key, batch.value, batch.key_cache, batch.value_cache, md.slot_mapping)
    for window in (None, 5):
        out = paged_attention(batch.query, batch.key_cache, batch.value_cache, md, 0.25,
                              num_splits=2, sliding_window=window, logits_soft_cap=5.0)
        expected = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md,
                                       0.25, sliding_window=window, logits_soft_cap=5.0)
        uncapped = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md,
                                       0.25, sliding_window=window)
        assert relative_error(uncapped, expected) > 1e-2
        assert relative_error(out, expected) < TOL[dtype]
