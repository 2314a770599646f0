"""compute_topk_logprobs against log_softmax, and the sampler's logprobs columns."""

from __future__ import annotations

import pytest
import torch

from pagoda.sample.logprobs import compute_topk_logprobs
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams as SP
from pagoda.messages import LogprobsLists


def test_chosen_and_topk_columns_match_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(7, 100) * 3
    chosen = torch.randint(0, 100, (7,))
    out = compute_topk_logprobs(logits, chosen, k=4)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.token_ids.shape == out.logprobs.shape == out.ranks.shape == (7, 5)
    assert torch.equal(out.token_ids[:, 0], chosen)
    assert torch.allclose(out.logprobs[:, 0], ref.gather(1, chosen[:, None]).squeeze(1))
    top_values, top_ids = ref.topk(4, dim=-1)
    assert torch.equal(out.token_ids[:, 1:], top_ids)
    assert torch.allclose(out.logprobs[:, 1:], top_values)
    assert out.ranks[:, 1:].tolist() == [[1, 2, 3, 4]] * 7
    # Rank = 1-based position of the chosen token when the row is sorted best-first.
    order = ref.argsort(dim=-1, descending=True)
    expected_ranks = [(order[i] == chosen[i]).nonzero().item() + 1 for i in range(7)]
    assert out.ranks[:, 0].tolist() == expected_ranks
    assert logits.dtype == torch.float32 and out.token_ids.dtype == torch.long


def test_tied_token_ranks_after_its_equals_and_k_zero():
    logits = torch.tensor([[2.0, 5.0, 2.0, 1.0]])
    out = compute_topk_logprobs(logits, torch.tensor([2]), k=0)
    assert out.token_ids.tolist() == [[2]] and out.ranks.tolist() == [[3]]


def test_prompt_logprobs_score_the_next_token_of_each_position():
    logits = torch.tensor([[0.0, 10.0, 0.0], [10.0, 0.0, 1.0]])
    out = compute_topk_logprobs(logits, torch.tensor([1, 2]), k=1)
    assert out.ranks[:, 0].tolist() == [1, 2]
    assert out.logprobs[0, 0].item() == pytest.approx(0.0, abs=1e-4)


def test_k_larger_than_vocab_is_rejected():
    with pytest.raises(ValueError, match="k must be"):
        compute_topk_logprobs(torch.zeros(1, 3), torch.tensor([0]), k=4)


def test_tolists_gives_runner_output_lists():
    out = compute_topk_logprobs(torch.tensor([[0.0, 1.0]]), torch.tensor([0]), k=1)
    lists = out.tolists()
    assert isinstance(lists, LogprobsLists)
    assert lists.token_ids == [[0, 1]] and lists.ranks == [[2, 1]]
    assert lists.logprobs[0][1] == pytest.approx(-0.3132617, abs=1e-6)


def test_sampler_logprobs_come_from_raw_logits(build):
    """Temperature, penalties and bias change the choice, not the reported logprobs."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SP(temperature=0.0, logprobs=3), SP(temperature=0.3, logprobs=1),
              SP(temperature=0.0, repetition_penalty=2.0, logit_bias={7: 5.0}), SP(top_k=5)]
    md = build(params, 50, prompts=[[1, 2]] * 4, outputs=[[3]] * 4)
    raw = logits.clone()
    out = Sampler()(logits, md)
    assert torch.equal(logits, raw)
    ref = torch.log_softmax(raw, dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == (4, 4)  # k = max over rows = 3
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    chosen = out.sampled_token_ids[:, None]
    assert torch.allclose(lp.logprobs[:, 0], ref.gather(1, chosen).squeeze(1))
    assert torch.equal(lp.token_ids[:, 1:], ref.topk(3, dim=-1).indices)
    assert out.sampled_token_ids[2].item() == 7  # biased greedy row


def test_no_logprobs_requested_gives_none(build):
    out = Sampler()(torch.randn(2, 10), build([SP(), SP(temperature=0.0)], 10))
    assert out.logprobs is None
