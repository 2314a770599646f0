"""CUDA-graph batch sizes and bucket selection (pure functions), and capture on a GPU."""

from __future__ import annotations

import pytest
import torch

from pagoda.worker.cuda_graphs import DecodeCUDAGraphs, cuda_graph_sizes, select_graph_size


def test_capture_sizes_follow_vllm_and_always_cover_max_num_seqs():
    assert cuda_graph_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert cuda_graph_sizes(1) == [1]
    assert cuda_graph_sizes(3) == [1, 2, 3]
    assert cuda_graph_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("num_reqs,expected", [
    (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (17, 24), (255, 256), (256, 256),
    (257, None), (0, None),
])
def test_select_smallest_captured_size_at_least_the_batch(num_reqs, expected):
    assert select_graph_size(num_reqs, cuda_graph_sizes(256)) == expected


def test_selection_is_smallest_cover_for_every_batch_size():
    sizes = [1, 2, 4, 8, 16, 24, 32, 40]
    for n in range(1, 41):
        chosen = select_graph_size(n, sizes)
        assert chosen >= n and all(s < n for s in sizes if s < chosen)


@pytest.mark.cuda
def test_replay_matches_eager_forward_with_padding():
    from pagoda.kernels.testing import random_paged_batch
    from pagoda.model import ops

    # A one-layer "model": write K/V then attend, so a replay that read stale inputs,
    # wrote padding rows or skipped the cache write would show in the output.
    heads, kv_heads, dim = 8, 2, 64
    batch = random_paged_batch([(37, 1), (5, 1), (200, 1)], heads, kv_heads, dim, 16,
                               dtype=torch.bfloat16, device="cuda")
    cache = (batch.key_cache, batch.value_cache)
    keys = torch.randn(64, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    queries = torch.randn(64, heads, dim, dtype=torch.bfloat16, device="cuda")

    def forward(input_ids, positions, md):
        ops.write_kv_cache(keys[input_ids], keys[input_ids], *cache, md.slot_mapping)
        return ops.paged_attention(queries[input_ids], *cache, md, 0.125).flatten(1)

    graphs = DecodeCUDAGraphs(forward, [1, 2, 4, 8], max_blocks_per_req=32, max_seq_len=512,
                              device=torch.device("cuda"))
    graphs.capture()
    input_ids = torch.tensor([3, 9, 27], device="cuda")
    md = batch.attn_metadata
    assert graphs.can_run(md, 3)
    cache_before = [c.clone() for c in cache]
    replayed = graphs.run(input_ids, input_ids, md).clone()
    cache_after_replay = [c.clone() for c in cache]
    for c, before in zip(cache, cache_before):
        c.copy_(before)
    eager = forward(input_ids, input_ids, md)
    torch.testing.assert_close(replayed, eager)
    for c, replay_c in zip(cache, cache_after_replay):
        assert torch.equal(c, replay_c)
