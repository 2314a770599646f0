"""Draft verification keeps the target's output: greedy exactly, sampled in distribution."""

import math

import torch

from pagoda.sample.builder import build_sampling_metadata
from pagoda.sample.rejection_sampler import verify_drafts
from pagoda.sampling_params import SamplingParams

VOCAB = 6


def metadata(params, outputs):
    return build_sampling_metadata(params, [[0]] * len(params), outputs, {}, VOCAB,
                                   [[]] * len(params))


def test_greedy_accepts_matching_drafts_and_corrects_the_first_miss():
    # Request 0 drafts [2, 3, 4]: targets 2, 3, then 1 -> emits 2, 3, 1.
    # Request 1 drafts [5]: target 5, bonus row says 0 -> emits 5, 0.
    logits = torch.full((6, VOCAB), -5.0)
    for row, token in enumerate([2, 3, 1, 9, 5, 0]):
        if token < VOCAB:
            logits[row, token] = 5.0
    greedy = SamplingParams(temperature=0)
    out = verify_drafts(logits, metadata([greedy] * 6, [[]] * 6), [[2, 3, 4], [5]])
    assert out.token_ids[0] == [2, 3, 1]
    assert out.token_ids[1] == [5, 0]
    assert out.rows == [[0, 1, 2], [4, 5]]


def test_greedy_rows_see_their_drafts_as_output_for_penalties():
    # Row 1 comes after draft 2: a huge presence penalty on the row's outputs (the
    # draft) must move its argmax from 2 to 3, exactly as sequential decoding would.
    logits = torch.tensor([[0, 0, 9.0, 8.0, 0, 0]] * 2)
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    out = verify_drafts(logits, metadata([params] * 2, [[], [2]]), [[2]])
    assert out.token_ids == [[2, 3]]


def test_sampled_tokens_keep_the_target_distribution():
    """Over many requests with the same target p and the same draft token, the first
    emitted token is distributed as p (the draft only changes how it is drawn), and
    so is the second given that the first draft was accepted."""
    torch.manual_seed(0)
    p0 = torch.tensor([0.05, 0.4, 0.25, 0.1, 0.15, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.2, 0.1])
    n = 20000
    logits = torch.stack([p0.log(), p1.log()] * n)
    params = [SamplingParams(temperature=1.0)] * (2 * n)
    out = verify_drafts(logits, metadata(params, [[]] * (2 * n)), [[1]] * n)
    first = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=VOCAB)
    assert _chi_square(first, p0) < 20.5  # 5 dof, p = 0.001
    seconds = [t[1] for t in out.token_ids if len(t) == 2]
    assert abs(len(seconds) / n - p0[1].item()) < 0.02  # the draft is accepted w.p. p0(1)
    second = torch.bincount(torch.tensor(seconds), minlength=VOCAB)
    assert _chi_square(second, p1) < 20.5


def test_logprobs_come_from_each_emitted_tokens_row():
    logits = torch.tensor([[0, 0, 9.0, 0, 0, 0], [0, 0, 0, 0, 9.0, 0]])
    params = SamplingParams(temperature=0, logprobs=1)
    out = verify_drafts(logits, metadata([params] * 2, [[], [2]]), [[2]])
    assert out.token_ids == [[2, 4]]
    lists = out.logprobs.tolists()
    assert [row[0] for row in lists.token_ids] == [2, 4]
    assert all(math.isclose(row[0], math.log(1 / (1 + 5 * math.exp(-9))), abs_tol=1e-6) for row in lists.logprobs)


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())
