"""The grouped-GEMM experts kernel against the torch path (`moe.experts_by_group`), and the
host-sync-free layout of pairs it runs on."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.fused_moe import align_pairs, fused_experts
from pagoda.model.moe import experts_by_group


def test_align_pairs_groups_each_experts_pairs_in_padded_runs():
    # 3 tokens, 2 slots: pairs 0..5 route to experts 2, 0, 2, 3, 0, 2; this rank holds 0..2.
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    sorted_ids, block_expert, padded = align_pairs(ids, 0, 3, block_m=2)
    pad = 6
    # expert 0: pairs 1, 4; expert 1: none; expert 2: pairs 0, 2, 5 (padded to 4);
    # pair 3 (expert 3, another rank's) appears nowhere.
    assert padded.tolist() == [6]
    assert sorted_ids[:6].tolist() == [1, 4, 0, 2, 5, pad]
    assert set(sorted_ids[6:].tolist()) <= {pad}
    assert block_expert[:3].tolist() == [0, 2, 2]
    assert sorted_ids.numel() == -(-(6 + 3 * 1) // 2) * 2  # capacity: T k + E (BLOCK_M - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
@pytest.mark.parametrize("expert_start,num_local", [(0, 5), (2, 2)])
def test_fused_experts_match_the_torch_path(device, dtype, num_tokens, expert_start, num_local):
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, inter, num_experts, top_k = 24, 20, 5, 2
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=gen) * 0.3).to(dtype)
    w2 = (torch.randn(num_local, hidden, inter, generator=gen) * 0.3).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(num_tokens)])
    expected = experts_by_group(x, ids, w13, w2, expert_start)
    out = fused_experts(x.to(device), ids.to(device), w13.to(device), w2.to(device),
                        expert_start).cpu()
    held = (ids.reshape(-1) >= expert_start) & (ids.reshape(-1) < expert_start + num_local)
    assert torch.equal(out[~held], torch.zeros_like(out[~held]))
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    else:  # the torch path rounds each product to bf16 in another order
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
