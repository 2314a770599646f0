"""The torch paged attention against a dense per-request reference, and the KV cache ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda.config import ModelArchConfig
from pagoda.model.attention import paged_attention, write_kv_cache
from pagoda.model.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block


def dense_reference(q, keys, values, context_lens, scale, window=None, soft_cap=None,
                    sinks=None):
    """Per request: causal attention of its queries over its full key sequence, fp64.

    keys/values[i] hold request i's whole sequence [S, Hkv, D]; its queries are the
    last rows. Built from the un-paged tensors, so it shares no code with the cache.
    `window` W: query p sees keys p - W < k <= p; `soft_cap` c: scores c * tanh(s / c);
    `sinks` [H]: head h's softmax denominator gains exp(sinks[h]) (gpt-oss).
    """
    outs, row = [], 0
    for k, v, ctx in zip(keys, values, context_lens):
        seq_len = k.shape[0]
        n = seq_len - ctx
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row:row + n].double(), kk) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        k_pos, q_pos = torch.arange(seq_len)[None, :], torch.arange(ctx, seq_len)[:, None]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            denominator = scores.exp().sum(-1, keepdim=True) + sinks.double().exp()[:, None, None]
            probs = scores.exp() / denominator
        outs.append(torch.einsum("hqk,khd->qhd", probs, vv))
        row += n
    return torch.cat(outs)


def run_paged(requests, heads, kv_heads, head_dim, block_size, dtype, paged_sequences, seed=0,
              window=None, soft_cap=None, poison_out_of_window=False, sinks=None,
              batch_invariant=False):
    """requests: (context_len, query_len), decodes first. Writes every sequence's
    context in earlier steps, then runs the batch; returns (ours, reference).
    `poison_out_of_window`: block-table entries wholly before each request's window
    point at a NaN block (the KV cache manager may have released those blocks)."""
    g = torch.Generator().manual_seed(seed)
    seqs = paged_sequences(num_blocks=256, block_size=block_size, layout="shuffled", seed=seed)
    key_cache, value_cache = allocate_kv_caches(
        ModelArchConfig(1, 1, 1, 1, heads, kv_heads, head_dim), 256, block_size, dtype, "cpu")[0]
    keys, values = [], []
    for i, (ctx, n) in enumerate(requests):
        seqs.add(str(i), list(range(ctx + n)))
        keys.append(torch.randn(ctx + n, kv_heads, head_dim, generator=g).to(dtype))
        values.append(torch.randn(ctx + n, kv_heads, head_dim, generator=g).to(dtype))
        if ctx:  # the cached context, written by an earlier step
            _, _, md = seqs.step([(str(i), ctx)])
            write_kv_cache(keys[i][:ctx], values[i][:ctx], key_cache, value_cache, md.slot_mapping)
    _, _, md = seqs.step([(str(i), n) for i, (_, n) in enumerate(requests)])
    total = sum(n for _, n in requests)
    query = torch.randn(total, heads, head_dim, generator=g).to(dtype)
    new_k = torch.cat([k[ctx:] for k, (ctx, _) in zip(keys, requests)])
    new_v = torch.cat([v[ctx:] for v, (ctx, _) in zip(values, requests)])
    write_kv_cache(new_k, new_v, key_cache, value_cache, md.slot_mapping)
    scale = head_dim ** -0.5
    if poison_out_of_window:
        nan_block = seqs.free.pop()
        key_cache[nan_block] = value_cache[nan_block] = float("nan")
        for i, (ctx, _) in enumerate(requests):
            md.block_tables[i, :max(0, ctx - window + 1) // block_size] = nan_block
    if batch_invariant:
        md = dataclasses.replace(md, batch_invariant=True)
    out = paged_attention(query, key_cache, value_cache, md, scale, window, soft_cap,
                          sinks=sinks)
    return out, dense_reference(query, keys, values, [c for c, _ in requests], scale, window,
                                soft_cap, sinks)


MIXED = [(0, 1), (9, 1), (30, 1), (0, 12), (7, 5), (16, 1 + 16), (3, 40)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch_equals_dense_reference(paged_sequences, heads, kv_heads, block_size):
    # Decodes with contexts 0..30 first, then a fresh prefill, chunks behind cached
    # prefixes (one starting mid-block) and a single prefill spanning many blocks.
    out, ref = run_paged(MIXED, heads, kv_heads, 16, block_size, torch.float32, paged_sequences)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("requests", [[(5, 1), (0, 1), (40, 1)], [(0, 20)], [(11, 6)]],
                         ids=["decodes-only", "one-prefill", "prefix-chunk-only"])
def test_single_kind_batches(paged_sequences, requests):
    out, ref = run_paged(requests, 6, 2, 32, 4, torch.float32, paged_sequences, seed=3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_sliding_window_equals_dense_reference_without_reading_released_blocks(
        paged_sequences, window, block_size):
    out, ref = run_paged(MIXED, 6, 2, 16, block_size, torch.float32, paged_sequences,
                         window=window, poison_out_of_window=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_soft_capped_scores_equal_dense_reference(paged_sequences, window):
    out, ref = run_paged(MIXED, 4, 2, 16, 4, torch.float32, paged_sequences, seed=2,
                         window=window, soft_cap=0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    uncapped, _ = run_paged(MIXED, 4, 2, 16, 4, torch.float32, paged_sequences, seed=2,
                            window=window)
    assert not torch.allclose(out, uncapped, atol=1e-3)  # the cap changes the result


@pytest.mark.parametrize("window,batch_invariant", [(None, False), (7, False), (None, True),
                                                    (7, True)])
def test_attention_sinks_equal_dense_reference(paged_sequences, window, batch_invariant):
    # One learned logit per query head in each softmax's denominator (gpt-oss), over
    # decodes and prefills, GQA (head h of kv head h // 3), with and without a window.
    sinks = 2 * torch.randn(6, generator=torch.Generator().manual_seed(5))
    out, ref = run_paged(MIXED, 6, 2, 16, 4, torch.float32, paged_sequences, seed=4,
                         window=window, sinks=sinks, batch_invariant=batch_invariant)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    plain, _ = run_paged(MIXED, 6, 2, 16, 4, torch.float32, paged_sequences, seed=4,
                         window=window, batch_invariant=batch_invariant)
    assert not torch.allclose(out, plain, atol=1e-3)  # the sinks change the result


def test_bfloat16_stays_close_to_exact(paged_sequences):
    out, ref = run_paged(MIXED, 6, 2, 64, 16, torch.bfloat16, paged_sequences, seed=1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_write_kv_cache_stores_each_token_at_its_slot():
    key_cache, value_cache = torch.zeros(2, 6, 4, 2, 3), torch.zeros(2, 6, 4, 2, 3)
    key, value = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    write_kv_cache(key, value, key_cache[0], value_cache[0], torch.tensor([17, 2, 4]))
    assert torch.equal(key_cache[0, 4, 1], key[0]) and torch.equal(value_cache[0, 4, 1], value[0])
    assert torch.equal(key_cache[0, 0, 2], key[1]) and torch.equal(key_cache[0, 1, 0], key[2])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 3  # nothing else written


def test_kv_cache_allocation_and_size():
    arch = ModelArchConfig(vocab_size=10, hidden_size=576, intermediate_size=8,
                           num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64)
    caches = allocate_kv_caches(arch, num_blocks=5, block_size=16, dtype=torch.bfloat16,
                                device="cpu")
    assert len(caches) == 30
    k, v = caches[0]
    assert k.shape == v.shape == (5, 16, 3, 64) and k.dtype == torch.bfloat16
    assert not k.any() and k.data_ptr() != v.data_ptr()
    # SmolLM2 in bf16: 2 (K, V) * 16 tokens * 3 heads * 64 dims * 2 bytes * 30 layers.
    assert kv_cache_bytes_per_block(arch, 16, torch.bfloat16) == 368640
    assert kv_cache_bytes_per_block(arch, 16, torch.float32) == 2 * 368640
    total = sum(t.numel() * t.element_size() for pair in caches for t in pair)
    assert total == 5 * kv_cache_bytes_per_block(arch, 16, torch.bfloat16)


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib * 1024


def test_a_large_cpu_kv_cache_is_zero_and_commits_memory_only_as_it_is_written():
    """Start-up: the default model's 2 GiB cache used to be written full of zeros before
    the replica served (seconds); now its pages are zero-filled by the kernel on first
    touch, so allocating costs no time and no resident memory up front."""
    arch = ModelArchConfig(vocab_size=10, hidden_size=576, intermediate_size=8,
                           num_hidden_layers=4, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64)
    num_blocks = 4096  # 96 MiB per tensor, 768 MiB in all
    before = _rss_bytes()
    caches = allocate_kv_caches(arch, num_blocks, 16, torch.bfloat16, "cpu")
    assert _rss_bytes() - before < 64 * 2**20
    k, v = caches[2]
    assert k.shape == (num_blocks, 16, 3, 64) and k.is_contiguous()
    assert not k[-1].any() and not v[0].any()
    k[7].fill_(1.5)  # layers and halves are separate tensors: writing one leaves the rest
    assert k[7].eq(1.5).all() and not caches[1][0][7].any() and not v[7].any()
    del k, v, caches  # the mappings go with the last view
