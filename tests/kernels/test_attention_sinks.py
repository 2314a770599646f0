"""Attention sinks (gpt-oss) in the Triton paged attention, against the torch references.

A sink is one learned logit per query head that joins every softmax's denominator and
adds no value. The kernels fold it in once per row after the last key tile (decode
with one split, prefill), or once in the split-K reduce: never per split. Sinks are
drawn large and distinct per head, so a sink dropped, added per split, or read for the
wrong head (GQA: head h = kv_head * group + g) moves the output far past tolerance.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import reference as ref
from pagoda.kernels.attention import paged_attention
from pagoda.kernels.kv_cache import write_kv_cache
from pagoda.kernels.paged_decode import choose_num_splits
from pagoda.kernels.testing import random_paged_batch, relative_error
from pagoda.model import attention as torch_attention

GQA = [(4, 4), (6, 2), (8, 1)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SCALE = 0.25


def random_sinks(num_heads: int, dtype, device, seed: int = 0, mean: float = 1.0) -> torch.Tensor:
    """Distinct per head, around the scores' size (a long context needs a larger `mean`:
    the sink competes with every key), so each one visibly moves its head's output."""
    gen = torch.Generator().manual_seed(seed)
    return (1.5 * torch.randn(num_heads, generator=gen) + mean).to(dtype).to(device)


def written(batch):
    write_kv_cache(batch.key, batch.value, batch.key_cache, batch.value_cache,
                   batch.attn_metadata.slot_mapping)
    return batch


def check(batch, sinks, tol, window=None, num_splits=None, soft_cap=None):
    md = batch.attn_metadata
    expected = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, SCALE,
                                   sliding_window=window, logits_soft_cap=soft_cap, sinks=sinks)
    no_sinks = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, SCALE,
                                   sliding_window=window, logits_soft_cap=soft_cap)
    assert relative_error(no_sinks, expected) > 5e-2  # the sinks really matter here
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, md, SCALE,
                          num_splits=num_splits, sliding_window=window,
                          logits_soft_cap=soft_cap, sinks=sinks)
    assert out.dtype == batch.query.dtype
    err = relative_error(out, expected)
    assert err < tol, f"relative error {err}"


def test_reference_sinks_mean_what_the_model_torch_path_means(device):
    """The kernels' oracle and the model's torch path (what gpt-oss runs on the CPU, equal
    to transformers in tests/model) agree on sinks, GQA head order included."""
    batch = written(random_paged_batch([(5, 1), (30, 1), (0, 6), (7, 9)], 6, 2, 16, 4,
                                       device=device, seed=4))
    sinks = random_sinks(6, torch.float32, device)
    md = batch.attn_metadata
    for window in (None, 5):
        want = torch_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                               md, SCALE, window, None, None, sinks)
        got = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, SCALE,
                                  sliding_window=window, sinks=sinks)
        assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_sinks_in_a_mixed_batch_of_decodes_and_prefills(device, dtype, heads, kv_heads):
    # Decodes (short, long, empty prefix), a fresh prefill, a chunk behind a cached prefix,
    # a prefill longer than one query tile: both kernels in one step.
    requests = [(5, 1), (40, 1), (0, 1), (0, 7), (9, 13), (3, 35)]
    batch = written(random_paged_batch(requests, heads, kv_heads, head_dim=24, block_size=4,
                                       dtype=dtype, device=device, seed=heads))
    check(batch, random_sinks(heads, dtype, device, seed=heads), TOL[dtype], num_splits=1)


@pytest.mark.parametrize("num_splits", [None, 2, 3, 8])
def test_sinks_are_added_once_across_decode_splits(device, num_splits):
    """Split-K decodes: the sink joins the merged denominator once. 8 splits of the short
    contexts leave empty splits; None takes the heuristic, which splits this context."""
    requests = [(600, 1), (2, 1), (70, 1)]
    assert choose_num_splits(3, 2, 601, torch.device(device)) > 1
    batch = written(random_paged_batch(requests, 6, 2, head_dim=16, block_size=8, device=device,
                                       seed=7))
    check(batch, random_sinks(6, torch.float32, device, seed=7, mean=4.0), 1e-5,
          num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_with_split_decodes_in_bf16_too(device, dtype):
    batch = written(random_paged_batch([(300, 1), (45, 1)], 8, 2, head_dim=32, block_size=16,
                                       dtype=dtype, device=device, seed=8))
    check(batch, random_sinks(8, dtype, device, seed=8, mean=4.0), TOL[dtype], num_splits=4)


@pytest.mark.parametrize("window", [1, 6, 13])
def test_sinks_with_a_sliding_window(device, window):
    """gpt-oss alternates sliding and full layers; a window of 1 leaves each query its own
    key and the sink only. Released blocks before the window hold NaN: never read."""
    from test_attention_kernels import WINDOW_REQUESTS, poison_blocks_out_of_window

    batch = written(random_paged_batch(WINDOW_REQUESTS, 6, 2, head_dim=16, block_size=4,
                                       device=device, seed=window))
    sinks = random_sinks(6, torch.float32, device, seed=window)
    md = batch.attn_metadata
    expected = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, SCALE,
                                   sliding_window=window, sinks=sinks)
    poison_blocks_out_of_window(batch, window)
    for num_splits in (1, 3):
        out = paged_attention(batch.query, batch.key_cache, batch.value_cache, md, SCALE,
                              num_splits=num_splits, sliding_window=window, sinks=sinks)
        assert relative_error(out, expected) < 1e-5


def test_sinks_with_soft_capped_scores(device):
    batch = written(random_paged_batch([(9, 1), (0, 5), (5, 11)], 4, 2, head_dim=16,
                                       block_size=4, device=device, seed=5))
    batch.query.mul_(4)
    check(batch, random_sinks(4, torch.float32, device, seed=5), 1e-5, num_splits=2,
          soft_cap=5.0)


def test_padding_request_with_sinks_yields_zeros(device):
    """A seq_len-0 padding request sees no key: the sink takes all the weight, output 0
    (no NaN from an empty softmax), in both the one-split and the split-K paths."""
    batch = written(random_paged_batch([(7, 1), (0, 1)], 4, 2, head_dim=16, block_size=4,
                                       device=device))
    md = batch.attn_metadata
    md.seq_lens[1] = 0
    md.seq_lens_cpu[1] = 0
    sinks = random_sinks(4, torch.float32, device)
    expected = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, SCALE,
                                   sinks=sinks)
    for num_splits in (1, 2):
        out = paged_attention(batch.query, batch.key_cache, batch.value_cache, md, SCALE,
                              num_splits=num_splits, sinks=sinks)
        assert relative_error(out[:1], expected[:1]) < 1e-5
        assert torch.count_nonzero(out[1:]) == 0


def test_rejects_sinks_of_the_wrong_shape(device):
    batch = random_paged_batch([(3, 1)], 4, 2, head_dim=16, block_size=4, device=device)
    with pytest.raises(AssertionError, match="sinks"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.attn_metadata,
                        SCALE, sinks=torch.zeros(2, device=device))
