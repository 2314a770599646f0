"""The MoE layer's pieces: routing (softmax top-k, renormalised or not) and the batched
torch path of the experts against the obvious per-token computation."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.moe import experts_by_group, select_experts


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_is_softmax_top_k(renormalize):
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids = select_experts(logits, 2, renormalize)
    assert ids.tolist() == [[1, 2], [3, 0]]
    expected = torch.softmax(logits, dim=-1).gather(1, ids)
    if renormalize:  # Mixtral / norm_topk_prob: the k weights sum to 1
        expected = expected / expected.sum(dim=1, keepdim=True)
    torch.testing.assert_close(weights, expected)


def test_experts_by_group_equals_a_per_token_loop():
    # Expert 3 gets no token, expert 0 several.
    torch.manual_seed(0)
    x, w13, w2 = torch.randn(6, 8), torch.randn(4, 10, 8), torch.randn(4, 8, 5)
    ids = torch.tensor([[0, 1], [0, 2], [1, 0], [2, 0], [0, 1], [1, 2]])
    out = experts_by_group(x, ids, w13, w2, expert_start=0)
    for t in range(6):
        for slot in range(2):
            e = ids[t, slot]
            gate, up = (w13[e] @ x[t]).chunk(2)
            want = w2[e] @ (torch.nn.functional.silu(gate) * up)
            torch.testing.assert_close(out[t * 2 + slot], want, atol=1e-5, rtol=1e-5)
    # A rank holding experts 2..3 only: pairs of experts 0 and 1 are zero rows.
    part = experts_by_group(x, ids, w13[2:], w2[2:], expert_start=2)
    held = ids.reshape(-1) >= 2
    assert torch.equal(part[~held], torch.zeros_like(part[~held]))
    torch.testing.assert_close(part[held], out[held])
